"""Joining data-parallel replicas at engine construction (torch.distributed already initialised):
the replicas' groups, the plan they all run (``Plan.replicas``, ``Plan.optimizer_sharding``), this
rank's local devices, the start-up consistency check, and this rank's rows of a global batch."""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch
from torch import nn

from tinypipe.config import Config
from tinypipe.distributed.consistency import check_consistent, fingerprint, weights_checksum
from tinypipe.distributed.group import Replicas, replicas_from_environment, resolve_sharding
from tinypipe.distributed.topology import Topology
from tinypipe.distributed.watchdog import EXIT_CODE
from tinypipe.errors import ConfigError
from tinypipe.planner.auto import resolve_plan
from tinypipe.planner.search import PlanResult
from tinypipe.runtime.exit_guard import ExitGuard
from tinypipe.schedule.plan import Plan

#: ``Config.extra`` knobs of the replicas (see :func:`join_replicas`)
SHARE_KEY, TIMEOUT_KEY, HEARTBEAT_KEY = "dp_share_devices", "dp_timeout_s", "dp_heartbeat_s"
SINGLE_KEY = "dp_single_rank"


def join_replicas(config: Config) -> Replicas | None:
    """This rank's replicas (None without an initialised multi-rank default group).

    ``Config.extra``: ``dp_share_devices`` (several ranks on one GPU: gloo, device names kept),
    ``dp_timeout_s`` (every collective's timeout, default 30 min: long saves happen between
    barriers; the watchdog ends a run with a dead or hung peer long before), ``dp_heartbeat_s``
    (a silent peer ends this process after it, default 30 s; 0: no watchdog), ``dp_single_rank``
    (a one-rank group is a replica too: every collective of the replicas runs, each an identity --
    the NCCL path on one GPU, where NCCL refuses two ranks)."""
    extra = config.extra
    single = bool(extra.get(SINGLE_KEY, False))
    topo = Topology.from_process_group(single)
    if topo is None:
        return None
    share = bool(extra.get(SHARE_KEY, False))
    heartbeat = float(extra.get(HEARTBEAT_KEY, 30.0))
    return replicas_from_environment(local_devices(config, topo), share=share,
                                     sharding=resolve_sharding(config.optimizer_sharding),
                                     timeout_s=float(extra.get(TIMEOUT_KEY, 1800.0)),
                                     heartbeat_s=heartbeat if heartbeat > 0 else None, single_rank=single)


def guard_exits(replicas: Replicas | None, guard: ExitGuard) -> None:
    """A failed peer ends this rank through ``guard`` (exit 75, no half-written checkpoint), and
    any exit through ``guard`` -- a dead peer, SIGTERM -- first tells the peers this rank stops."""
    watchdog = replicas.watchdog if replicas is not None else None
    if watchdog is None:
        return

    def stop(line: str) -> None:
        guard.exit_now(line, EXIT_CODE)

    watchdog.on_dead = stop
    guard.on_exit(watchdog.say_stopping)


def local_devices(config: Config, topo: Topology | None) -> list[str]:
    """The devices this rank's engine drives (see :meth:`Topology.local_devices`)."""
    if topo is None:
        return list(config.devices)
    return topo.local_devices(list(config.devices), share=bool(config.extra.get(SHARE_KEY, False)))


def resolve_replica_plan(model: nn.Module, config: Config, replicas: Replicas | None, *, num_blocks: int,
                         tied: bool, plan: Plan | None) -> tuple[Plan, PlanResult | None]:
    """The plan this rank resolves (before :func:`replica_plan` makes every rank run rank 0's).

    With the workload given, the plan is one replica's for this node's host memory, shared by its
    replica processes (planner/auto.py: ``resolve_plan(..., replicas=R)``): with
    ``optimizer_sharding="auto"`` the planner weighs replicating the host optimizer state against
    sharding it and its choice becomes ``replicas.sharding``; a forced sharding is planned as such
    (planning a forced "shard" as a lone engine gave each rank the whole node's RAM and counted
    its moments whole). Without the workload: the plan of this rank's devices and batch share,
    with the sharding given ("auto": replicate)."""
    if replicas is None:
        return resolve_plan(model, config, num_blocks=num_blocks, tied=tied, plan=plan)
    if config.seq_len is not None and config.global_batch is not None:
        local = config.replace(devices=local_devices(config, replicas.topology))
        chosen, result = resolve_plan(model, local, num_blocks=num_blocks, tied=tied, plan=plan,
                                      replicas=replicas.size,
                                      replicas_per_node=replicas.topology.local_world_size)
        replicas.sharding = chosen.optimizer_sharding
        return chosen, result
    return resolve_plan(model, planning_config(config, replicas), num_blocks=num_blocks, tied=tied, plan=plan)


def planning_config(config: Config, replicas: Replicas | None) -> Config:
    """What the planner plans for on this rank: its own local devices and, when the workload is
    given, its share of the global batch."""
    if replicas is None:
        return config
    changes: dict[str, object] = {"devices": local_devices(config, replicas.topology)}
    if config.global_batch is not None and config.global_batch % replicas.size == 0:
        changes["global_batch"] = config.global_batch // replicas.size
    return config.replace(**changes)


def replica_plan(plan: Plan, replicas: Replicas | None, adopt_rank0: bool = False) -> Plan:
    """The plan every replica runs: ``plan`` with the replica count and the sharding choice (alone:
    ``plan``, which must not ask for replicas). ``adopt_rank0``: the planner chose it -- take rank
    0's (a planner probing free memory or rates may choose differently per rank); a plan the user
    gave must agree on every rank instead (:func:`check_replicas_agree`)."""
    if replicas is None:
        if plan.replicas > 1:
            raise ConfigError(f"the plan is for {plan.replicas} data-parallel replicas, but "
                              "torch.distributed is not initialised with several ranks: launch with torchrun "
                              f"--nproc-per-node {plan.replicas} (or init_process_group first)")
        return plan
    if adopt_rank0:
        plan = Plan.from_json(str(replicas.host.all_gather_object(plan.to_json())[0]))
        # the planner weighed the sharding too (it does for R > 1): rank 0's choice
        if replicas.size > 1 and plan.replicas == replicas.size:
            replicas.sharding = plan.optimizer_sharding
    return dataclasses.replace(plan, replicas=replicas.size, optimizer_sharding=replicas.sharding)


def check_replicas_agree(replicas: Replicas, config: Config, plan: Plan, model: nn.Module) -> None:
    """Refuse (ConfigError on every rank, naming the field) ranks that would train different
    things: config as given, plan, model class/config, initial weights."""
    weights = weights_checksum([p.detach() for p in model.parameters()])
    model_config = model.config.to_json_string() if hasattr(model, "config") else ""
    mine = fingerprint(config, plan.to_json(),
                       type(model).__name__, model_config, weights, replicas.size)
    check_consistent(replicas.host, mine)


def local_batch(batch: Mapping[str, torch.Tensor], replicas: Replicas) -> Mapping[str, torch.Tensor]:
    """This replica's rows of a global ``batch`` (every tensor split on dim 0; anything malformed is
    left for the batch validation to name)."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        return batch
    lo, hi = replicas.local_rows(int(ids.shape[0]))
    return {k: v[lo:hi] if isinstance(v, torch.Tensor) and v.ndim >= 1 else v for k, v in batch.items()}
