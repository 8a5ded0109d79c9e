"""The replicas' arithmetic without processes: shards tile each buffer exactly, the global batch
splits evenly (or is refused naming what would), CUDA device names map to each local rank's GPUs,
the schedule gains one reduction per layer on a collective lane, before that layer's download
(with replicas, or a one-rank group that asks for them)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinypipe.distributed.shards import Shard, padded_numel, shard_numel
from tinypipe.distributed.topology import Topology
from tinypipe.errors import BatchError
from tinypipe.schedule.builder import build_schedule
from tinypipe.schedule.ids import Kind, Lane, download_id, reduce_id
from tinypipe.schedule.plan import make_plan
from tinypipe.schedule.validate import validate


@given(st.integers(0, 10_000), st.integers(1, 9))
def test_shards_tile_the_buffer(n: int, replicas: int) -> None:
    shards = [Shard(n, replicas, r) for r in range(replicas)]
    assert shards[0].lo == 0 and shards[-1].hi == n
    for a, b in zip(shards, shards[1:]):
        assert a.hi == b.lo
    assert sum(s.numel for s in shards) == n
    assert all(s.numel <= s.size == shard_numel(n, replicas) for s in shards)
    assert padded_numel(n, replicas) - n < replicas  # under one element of padding per shard


def test_global_batch_splits_evenly_or_is_refused() -> None:
    assert [Topology(r, 3).split_rows(6) for r in range(3)] == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(BatchError, match=r"global batch of 5 sequences does not divide over 3 replicas: "
                                         r"use a multiple of 3 \(3 or 6\)"):
        Topology(0, 3).split_rows(5)
    with pytest.raises(BatchError, match=r"use a multiple of 4 \(4\)$"):
        Topology(0, 4).split_rows(2)


def test_local_devices() -> None:
    topo = Topology(rank=3, world_size=4, local_rank=1, local_world_size=2)
    assert topo.local_devices(["cuda:0"]) == ["cuda:1"]
    assert topo.local_devices(["cuda:0", "cuda:1"]) == ["cuda:2", "cuda:3"]  # a 2-GPU pipeline per replica
    assert topo.local_devices(["cuda:0"], share=True) == ["cuda:0"]  # several ranks on one GPU (gloo)
    assert topo.local_devices(["cpu", "cpu"]) == ["cpu", "cpu"]


def test_the_schedule_reduces_each_layer_before_its_download() -> None:
    import dataclasses

    plan = make_plan(4, pack_size=[1, 2, 1], micro_batch_size=1, backward_micro_batch_size=2, num_devices=2,
                     prefetch_window=1, stash="device", tied=False)
    alone = build_schedule(plan, 3, tied=False)
    assert not any(t.kind is Kind.REDUCE for t in alone.tasks.values())
    sched = build_schedule(dataclasses.replace(plan, replicas=2), 3, tied=False)
    validate(sched)
    layers = range(sched.num_layers)
    for layer in layers:
        red = sched.tasks[reduce_id(layer)]
        assert red.lane == Lane(red.device, "collective") and str(red.lane) == f"dev{red.device}:collective"
        assert sched.tasks[download_id(layer)].deps == (red.id,)
    assert len([t for t in sched.tasks.values() if t.kind is Kind.REDUCE]) == len(layers)
    one = build_schedule(plan, 3, tied=False, reduce=True)  # a one-rank group: the same reductions
    validate(one)
    assert {t.id: t.deps for t in one.tasks.values()} == {t.id: t.deps for t in sched.tasks.values()}


def test_a_replicas_plan_without_replicas_is_refused() -> None:
    import dataclasses

    import tinypipe
    from model_zoo import make_model

    plan = make_plan(4, pack_size=1, micro_batch_size=1, backward_micro_batch_size=1, num_devices=1,
                     prefetch_window=1, stash="device", tied=False)
    with pytest.raises(tinypipe.ConfigError, match="the plan is for 2 data-parallel replicas, but "
                                                   "torch.distributed is not initialised"):
        tinypipe.Engine(make_model("llama"), tinypipe.Config(devices=["cpu"]),
                        plan=dataclasses.replace(plan, replicas=2))
