"""Data-parallel replicas in the planner: R replicas of one per-replica plan (a pipeline over G local
GPUs, or one GPU) on N nodes of P GPUs, and how they hold the host AdamW state.

The runtime (``tinypipe.distributed``) trains ``global_batch / R`` sequences per replica and reduces
each layer's fp32 gradient on the device right after that layer's backward, overlapped with the
next layer's backward:

* ``replicate``: a ring all-reduce, ``2 (R-1)/R`` x the gradient's bytes per rank; every replica
  keeps the whole master copy and both AdamW moments and steps every layer.
* ``shard``: a reduce-scatter, ``(R-1)/R`` x; each rank downloads and steps only its 1/R shard of
  every layer, and the updated fp32 master slices are all-gathered (``(R-1)/R`` x 4 B/param over the
  interconnect) before the next step's uploads. Every replica still keeps the whole master copy it
  uploads from; only the moments (and retained gradients) are 1/R.

Host memory per node = replicas per node x one replica's host bytes: replicas on one node are
separate processes and each holds its own master copy (4 B/param) -- replicate ~ 4 + 8, shard
~ 4 + 8/R bytes per trainable parameter, plus what the single-replica estimate already counts
(pinned gradient pool, stashed activations of its 1/R of the batch, frozen LoRA base, the process).
A shard is ``ceil(n / R)`` elements of an ``n``-element layer (the largest rank's share).

Step time = the per-replica plan's predicted step (:func:`~tinypipe.planner.cost.predict_step_time`
on 1/R of the batch) + the collectives' exposed part + (shard) the all-gather. Replicas on a node
share its CPU: a replica's host AdamW runs at the machine's rate / replicas per node, on the whole
model (replicate) or on its 1/R (shard). Collectives run on one lane in the order gradients become
final (head, packs from the last, embedding), a pack's layers when its backward ends, at the ring's
bandwidth: the slowest link it crosses (within a node with several replicas per node, between
nodes with several nodes);
the exposed part is what is still running when the backward ends. The all-gather is counted in
full (not overlapped with the next forward), and a shard's gradient download at full size -- both
upper bounds. Not modelled: the collectives' NCCL buffers on the GPU, PCIe shared between peer
traffic and the host links, the SSD tier.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Sequence

from tinypipe.errors import ConfigError
from tinypipe.planner.candidate import HOST_BASELINE_BYTES
from tinypipe.planner.hardware import HardwareSpec
from tinypipe.planner.sharded_host import host_stepped
from tinypipe.planner.sizes import ModelSizes
from tinypipe.schedule.plan import OptimizerSharding, Plan
from tinypipe.units import gib_text

if TYPE_CHECKING:
    from tinypipe.planner.search import PlanResult

ShardingChoice = Literal["auto", "replicate", "shard"]
#: Bytes per gradient element the collectives move (the fp32 accumulators).
GRAD_BYTES = 4
#: Bytes per master element the shard's all-gather moves.
MASTER_BYTES = 4


@dataclass(frozen=True)
class Cluster:
    """N nodes of P GPUs, their links (GB/s) and each node's host memory budget."""

    nodes: int
    gpus_per_node: int
    intra_gbs: float  # GPU to GPU within a node
    inter_gbs: float  # node to node (unused on one node)
    host_bytes_per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"need >= 1 node and >= 1 GPU per node, got {self.nodes} x "
                              f"{self.gpus_per_node}")
        if not (self.intra_gbs > 0 and self.inter_gbs > 0):
            raise ConfigError("interconnect bandwidths must be positive")

    def ring_gbs(self, per_node: int) -> float:
        """The bandwidth a ring collective over the replicas gets, ``per_node`` of them on each node:
        its slowest link (links within a node only with several replicas there, between nodes only
        with several nodes)."""
        crossed = ([self.intra_gbs] if per_node > 1 else []) + ([self.inter_gbs] if self.nodes > 1 else [])
        return min(crossed) if crossed else self.intra_gbs


@dataclass(frozen=True)
class Layout:
    """R replicas of G GPUs each, ``per_node`` of them on every node."""

    replicas: int
    gpus_per_replica: int
    per_node: int

    @property
    def kind(self) -> str:
        if self.replicas == 1:
            return "pipeline"
        return "data parallel" if self.gpus_per_replica == 1 else "both"

    @property
    def nodes(self) -> int:
        """Nodes the layout uses."""
        return self.replicas // self.per_node

    def describe(self) -> str:
        g = self.gpus_per_replica
        return f"{self.replicas} x {g} GPU{'s' if g > 1 else ''}"


def layouts(cluster: Cluster, gpus_per_replica: int | None = None) -> list[Layout]:
    """Every way to cut each node's GPUs into equal replicas (G divides P), or only ``gpus_per_replica``;
    a replica's pipeline stays inside one node. On several nodes also one pipeline on one node (what
    the other nodes add, or that the network is too slow for them to add anything)."""
    P = cluster.gpus_per_node
    gs = [g for g in range(1, P + 1) if P % g == 0] if gpus_per_replica is None else [gpus_per_replica]
    for g in gs:
        if g < 1 or P % g:
            raise ConfigError(f"--gpus-per-replica {g} does not divide the {P} GPUs of a node "
                              f"(a replica's pipeline stays in one node): use one of "
                              f"{', '.join(str(d) for d in range(1, P + 1) if P % d == 0)}")
    out = [Layout(cluster.nodes * (P // g), g, P // g) for g in gs]
    if gpus_per_replica is None and cluster.nodes > 1:
        out.append(Layout(1, P, 1))
    return out


def split_batch(global_batch: int, replicas: int) -> int:
    """Sequences per replica; ConfigError (one line, saying which replica counts divide it) when the
    global batch does not split evenly."""
    if global_batch % replicas == 0:
        return global_batch // replicas
    divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
    up = -(-global_batch // replicas) * replicas
    raise ConfigError(f"global batch {global_batch} does not split evenly over {replicas} replicas: use "
                      f"{', '.join(map(str, divisors[:-1]))} or {divisors[-1]} replicas, or a global batch "
                      f"that {replicas} divides (e.g. {up})" if len(divisors) > 1 else
                      f"global batch {global_batch} does not split evenly over {replicas} replicas: use 1 "
                      f"replica, or a global batch that {replicas} divides (e.g. {up})")


def collective_bytes(sizes: ModelSizes, plan: Plan, replicas: int,
                     sharding: OptimizerSharding) -> list[float]:
    """Bytes each rank sends per runtime layer to reduce its gradient: a ring all-reduce
    ``2 (R-1)/R`` x the fp32 gradient, or with ``shard`` a reduce-scatter ``(R-1)/R`` x for the
    host-stepped layers (a layer stepped on its device keeps whole state: all-reduced)."""
    R = replicas
    host = host_stepped(sizes, plan)
    out = []
    for layer, n in enumerate(sizes.layer_train_numels):
        factor = (R - 1) / R if (sharding == "shard" and host[layer]) else 2 * (R - 1) / R
        out.append(factor * GRAD_BYTES * n)
    return out


def allgather_bytes(sizes: ModelSizes, plan: Plan, replicas: int) -> float:
    """Bytes each rank receives when the updated fp32 master slices are all-gathered (shard)."""
    R = replicas
    host = host_stepped(sizes, plan)
    return (R - 1) / R * MASTER_BYTES * sum(n for n, h in zip(sizes.layer_train_numels, host) if h)


def host_per_node(host: dict[str, int], per_node: int) -> int:
    """Host bytes of one node: ``per_node`` replica processes, each its own bytes and baseline."""
    return per_node * (sum(host.values()) + HOST_BASELINE_BYTES)


def replica_hardware(hw: HardwareSpec, layout: Layout, sharding: OptimizerSharding) -> HardwareSpec:
    """``hw`` as one replica sees it: the node's CPU AdamW rate shared by its replicas, and on 1/R
    of the parameters with ``shard`` (the same time as the whole model at R times the rate)."""
    rate = hw.cpu_adamw_gparams_s / layout.per_node
    if sharding == "shard":
        rate *= layout.replicas
    return dataclasses.replace(hw, cpu_adamw_gparams_s=rate)


def exposed_collective_s(sizes: ModelSizes, plan: Plan, backward_s: float, layer_bytes: Sequence[float],
                         ring_gbs: float) -> tuple[float, float]:
    """(seconds the collectives take on the link, seconds of them still running when the backward
    ends). One lane in the order gradients become final: the head's at the backward's start, each
    pack's when its backward ends (the phase shared by the packs' block counts), the embedding's at
    the end."""
    rate = ring_gbs * 1e9
    L = plan.num_blocks
    jobs = [(0.0, layer_bytes[-1])]  # (ready at, bytes): the head first
    t = 0.0
    for pack in reversed(plan.packs):
        t += backward_s * len(pack) / L
        jobs.append((t, sum(layer_bytes[1 + b] for b in pack)))
    jobs.append((backward_s, layer_bytes[0]))
    free = 0.0
    for ready, nbytes in jobs:
        free = max(free, ready) + nbytes / rate
    total = sum(nbytes for _, nbytes in jobs) / rate
    return total, max(0.0, free - backward_s)


@dataclass
class ShardingOption:
    """One layout with one sharding: its per-replica plan, host per node, and step time."""

    sharding: OptimizerSharding
    result: PlanResult | None = None  # the per-replica search's answer (None: a fixed plan weighed)
    plan: Plan | None = None  # the per-replica plan
    host: dict[str, int] = field(default_factory=dict)
    host_per_node: int = 0
    replica_step_s: float = 0.0
    collective_s: float = 0.0
    exposed_s: float = 0.0
    allgather_s: float = 0.0
    step_s: float = math.inf
    tokens_per_s: float = 0.0
    why_not: str = ""  # set when it does not fit

    @property
    def fits(self) -> bool:
        return not self.why_not


@dataclass
class LayoutPlan:
    """A layout's chosen sharding and why, with every sharding it weighed."""

    layout: Layout
    options: dict[str, ShardingOption]
    choice: ShardingOption | None
    reason: str
    refused: str = ""  # the global batch does not split over its replicas

    @property
    def fits(self) -> bool:
        return self.choice is not None and self.choice.fits

    @property
    def tokens_per_s(self) -> float:
        return self.choice.tokens_per_s if self.fits else 0.0

    def plan(self) -> Plan:
        """The per-replica plan with ``replicas`` and ``optimizer_sharding`` filled in."""
        assert self.choice is not None and self.choice.plan is not None
        return dataclasses.replace(self.choice.plan, replicas=self.layout.replicas,
                                   optimizer_sharding=self.choice.sharding)


def time_option(opt: ShardingOption, sizes: ModelSizes, plan: Plan, replica_step_s: float, backward_s: float,
                layout: Layout, cluster: Cluster, global_tokens: int) -> None:
    """Fill ``opt``'s step time: the replica's step + the exposed collectives (+ the all-gather)."""
    R = layout.replicas
    opt.replica_step_s = replica_step_s
    if R > 1:
        per_layer = collective_bytes(sizes, plan, R, opt.sharding)
        opt.collective_s, opt.exposed_s = exposed_collective_s(sizes, plan, backward_s, per_layer,
                                                               cluster.ring_gbs(layout.per_node))
        if opt.sharding == "shard":
            opt.allgather_s = allgather_bytes(sizes, plan, R) / (cluster.ring_gbs(layout.per_node) * 1e9)
    opt.step_s = replica_step_s + opt.exposed_s + opt.allgather_s
    opt.tokens_per_s = global_tokens / opt.step_s


def choose_sharding(options: dict[str, ShardingOption], budget: int,
                    replicas: int) -> tuple[ShardingOption | None, str]:
    """Replicate when it fits the host and is not slower, shard otherwise; with the reason (one line).
    ``options`` holds the shardings weighed (one: it was asked for, or there is one replica)."""
    if len(options) == 1:
        (name, only), = options.items()
        if not only.fits:
            return None, only.why_not
        why = "one replica, nothing to shard" if replicas == 1 else "as asked"
        return only, f"{name} ({why}): {gib_text(only.host_per_node)} host per node"
    rep, sh = options["replicate"], options["shard"]
    if rep.fits and (not sh.fits or rep.step_s <= sh.step_s):
        if not sh.fits:
            return rep, (f"replicate: fits the host ({gib_text(rep.host_per_node)} of {gib_text(budget)} per "
                         f"node); sharded does not ({sh.why_not})")
        return rep, (f"replicate: fits the host ({gib_text(rep.host_per_node)} of {gib_text(budget)} per "
                     f"node) and is not slower ({rep.step_s:.2f} vs {sh.step_s:.2f} s/step sharded)")
    if not sh.fits:
        return None, f"{rep.why_not}; {sh.why_not}"
    if not rep.fits:
        need = f"needs {gib_text(rep.host_per_node)} host per node" if rep.host_per_node else rep.why_not
        return sh, (f"shard: replicated state {need}, have {gib_text(budget)}; sharded needs "
                    f"{gib_text(sh.host_per_node)}")
    return sh, (f"shard: faster ({sh.step_s:.2f} vs {rep.step_s:.2f} s/step replicated, where every replica "
                "steps the whole model on the node's shared CPU)")
