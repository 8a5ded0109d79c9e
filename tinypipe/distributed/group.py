"""The replicas of one training run, as the engine uses them: the topology, one process group per
issuing thread (ops on a group must be issued in the same order on every rank, and each lane
issues in schedule order), the sharding choice and the watchdog.

Groups: ``host`` (gloo, CPU: token counts, the loss, start-up fingerprints; used by the main thread
and the host optimizer lane, never at once), ``gather`` (gloo, CPU: the sharded masters'
all-gathers) and, per device entry, ``grads[d]`` (the device's collective lane: each layer's
gradient reduction and, sharded, its norm; NCCL for CUDA tensors, gloo for CPU tensors or when
``share`` puts several ranks on one GPU).
"""

from __future__ import annotations

import datetime
import sys
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from tinypipe.distributed.collectives import Collectives
from tinypipe.distributed.links import PeerLinks
from tinypipe.distributed.shards import Shard
from tinypipe.distributed.topology import Topology
from tinypipe.distributed.watchdog import Watchdog

Sharding = Literal["replicate", "shard"]


def resolve_sharding(choice: str) -> Sharding:
    """``Config.optimizer_sharding`` -> the sharding the replicas start with. "auto" starts as
    "replicate"; with the workload given the planner's choice replaces it
    (runtime/replica_setup.py: ``resolve_replica_plan``). "shard" holds for any replica count, one
    too (a one-rank group, ``single_rank``: one shard, the whole buffer, through the same
    collectives)."""
    return "shard" if choice == "shard" else "replicate"


@dataclass
class Replicas:
    """This rank's replica among ``topology.world_size``; built by :func:`replicas_from_environment`."""

    topology: Topology
    host: Collectives
    gather: Collectives
    grads: dict[int, Collectives] = field(default_factory=dict)
    sharding: Sharding = "replicate"
    watchdog: Watchdog | None = None

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def size(self) -> int:
        return self.topology.world_size

    @property
    def is_main(self) -> bool:
        return self.topology.is_main

    def shard(self, n: int) -> Shard:
        """This rank's shard of a flat buffer of ``n`` elements."""
        return Shard(n, self.size, self.rank)

    def local_rows(self, batch: int) -> tuple[int, int]:
        return self.topology.split_rows(batch)

    def total_tokens(self, tokens: int) -> int:
        """Labelled tokens of the whole global batch: the loss is normalised by it on every replica, so
        the replicas' gradients sum to the global batch's gradient."""
        return int(self.host.sum_scalar(float(tokens), torch.int64))

    def explain_failure(self, exc: BaseException) -> str | None:
        """A step failed with ``exc``: when a collective failed (a peer's connection dropped, a
        timeout), give the watchdog its timeout to name the peer that died or hangs -- by default it
        ends this process with that line; returns the line when ``on_dead`` does not exit."""
        if self.watchdog is None or not is_collective_error(exc):
            return None
        return self.watchdog.await_verdict()

    def ending(self) -> None:
        """This rank is ending on its own (its engine closes): see :meth:`Watchdog.ending`."""
        if self.watchdog is not None:
            self.watchdog.ending()

    def close(self, failed: bool | None = None) -> None:
        """Leave the replicas, telling the peers whether this rank's run ended well (they stop
        watching it) or ``failed`` (they stop too; None: failed when an exception is on its way
        out, as in a ``finally`` after an error)."""
        if failed is None:
            failed = sys.exc_info()[0] is not None
        if self.watchdog is not None:
            self.watchdog.stop(leaving=not failed)


def is_collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause chain) came out of a collective: torch.distributed's errors, or
    gloo's / NCCL's RuntimeErrors."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        if isinstance(seen, dist.DistError) or any(w in text for w in ("gloo", "NCCL", "Connection")):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _group(backend: str, timeout: datetime.timedelta, topo: Topology) -> Collectives:
    g = dist.new_group(backend=backend, timeout=timeout)
    return Collectives(g, topo.rank, topo.world_size, backend, timeout)


def replicas_from_environment(devices: list[str], *, sharding: Sharding, share: bool = False,
                              timeout_s: float = 60.0, heartbeat_s: float | None = 30.0,
                              single_rank: bool = False) -> Replicas | None:
    """The replicas of the initialised default process group (None: not initialised, or one rank
    unless ``single_rank``: see :meth:`Topology.from_process_group`).

    Every rank must call this in the same order with the same ``devices`` (new groups are
    collective). ``timeout_s``: every collective's timeout; ``heartbeat_s``: a peer silent for this
    long ends this process (None: no watchdog); a peer whose process ended ends it at once (the
    watchdog's links, :mod:`~tinypipe.distributed.links`)."""
    topo = Topology.from_process_group(single_rank)
    if topo is None:
        return None
    timeout = datetime.timedelta(seconds=timeout_s)
    host = _group("gloo", timeout, topo)
    gather = _group("gloo", timeout, topo)
    grads = {}
    for i, d in enumerate(devices):
        backend = "nccl" if d.startswith("cuda") and not share else "gloo"
        grads[i] = _group(backend, timeout, topo)
    watchdog = None
    if heartbeat_s is not None:
        store = dist.distributed_c10d._get_default_store()  # torchrun's rendezvous store
        links = PeerLinks.connect(store, topo.rank, topo.world_size) if topo.world_size > 1 else None
        watchdog = Watchdog(store, topo.rank, topo.world_size, timeout_s=heartbeat_s, links=links)
        watchdog.beat()
        host.barrier()  # every rank's key exists before anyone reads it
        watchdog.start()
    return Replicas(topo, host, gather, grads, sharding, watchdog)
