"""One data-parallel rank's host bytes when the AdamW state is sharded over R replicas: a
host-stepped layer keeps 1/R of its moments (and retained gradient), a layer stepped on its device
keeps them whole, and every rank keeps the whole fp32 master. Shared by the per-replica search
(:mod:`tinypipe.planner.search`) and the replica comparison (:mod:`tinypipe.planner.replicas`),
so it depends on neither."""

from __future__ import annotations

import dataclasses

from tinypipe.planner.candidate import HOST_BASELINE_BYTES, Candidate
from tinypipe.planner.sizes import ModelSizes
from tinypipe.schedule.plan import Plan


def shard_numel(numel: int, replicas: int) -> int:
    """The largest rank's share of an ``numel``-element layer."""
    return -(-numel // replicas)


def host_stepped(sizes: ModelSizes, plan: Plan) -> list[bool]:
    """Per runtime layer (embedding, blocks, head): stepped by the host AdamW (not on a device)."""
    on_device = set().union(*(plan.device_optimized(d) for d in range(plan.num_devices)))
    return [layer not in on_device for layer in range(len(sizes.layer_train_numels))]


def sharded_host(host: dict[str, int], sizes: ModelSizes, plan: Plan, replicas: int,
                 retain_grads: bool) -> dict[str, int]:
    """One replica's host bytes by category with the optimizer state sharded: the moments (8 B) and
    retained gradients (4 B) of each host-stepped layer's 1/R shard; the master copy stays whole, and
    so does what the single-replica estimate counts for a layer stepped on its device."""
    out = dict(host)
    R = replicas
    trains = sizes.layer_train_numels
    stepped = host_stepped(sizes, plan)
    out["optimizer_state"] = sum(8 * (shard_numel(n, R) if h else n) for n, h in zip(trains, stepped))
    if retain_grads:
        out["gradient_buffers"] = sum(4 * shard_numel(n, R) for n, h in zip(trains, stepped) if h)
    return out


def sharded_candidate(c: Candidate, sizes: ModelSizes, replicas: int, retain_grads: bool) -> Candidate:
    """``c`` as one rank of ``replicas`` sharded replicas holds it: host categories by
    :func:`sharded_host` (what each layer really holds: a host-stepped layer's moments and retained
    gradient 1/R, a device-stepped one's whole) and the host need from them. The per-replica search
    fits this against one replica's budget, so a plan's own resident packs count as they are."""
    host = sharded_host(c.memory.host, sizes, c.plan, replicas, retain_grads)
    memory = dataclasses.replace(c.memory, host=host)
    return dataclasses.replace(c, memory=memory, host_need=sum(host.values()) + HOST_BASELINE_BYTES)
