"""Data-parallel replicas are exact: 2 and 3 gloo ranks on the CPU, each training its rows of every
global batch, end with the weights (and report the losses and gradient norms) of one process
training the whole global batch with torch.optim.AdamW -- to float rounding, under the
equivalence tests' tolerances (1e-5 relative per tensor, 1e-4 on the update vector), with
clipping triggering, full fine-tuning and LoRA, replicated and sharded optimizer state; and every
rank's weights are bit-identical. tests/test_distributed_negative.py shows that a missing global
normalisation or a doubled reduction fails these tolerances by orders of magnitude."""

from __future__ import annotations

from pathlib import Path

import pytest

from _dist_check import assert_exact
from _dist_run import run

CASES = {
    # clip 0.5 triggers every step: speculative steps undone and redone on every rank alike
    "r2_replicate_full_clip": (2, dict(family="llama", batch=6, steps=3,
                                       cfg=dict(pack_size=1, micro_batch_size=2, max_grad_norm=0.5,
                                                optimizer_sharding="replicate"))),
    # tied embeddings (the head's gradient lands in the embedding's), backward micro-batches of 3
    "r2_shard_full_tied_clip": (2, dict(family="qwen2", batch=6, steps=3,
                                        cfg=dict(pack_size=2, micro_batch_size=2, backward_micro_batch_size=3,
                                                 max_grad_norm=1.2, optimizer_sharding="shard"))),
    # a micro-batch-wise turn through the last 2 packs: its layers' reductions come after the turn
    "r2_shard_full_turn_clip": (2, dict(family="llama", batch=6, steps=3,
                                        cfg=dict(pack_size=1, micro_batch_size=1, turn_packs=2, max_grad_norm=0.5,
                                                 optimizer_sharding="shard"))),
    "r3_shard_lora_clip": (3, dict(family="llama", lora=True, batch=6, steps=3,
                                   cfg=dict(pack_size=1, micro_batch_size=1, max_grad_norm=0.05,
                                            optimizer_sharding="shard"))),
    "r3_replicate_full_two_devices": (3, dict(family="gpt2", batch=3, steps=2,
                                              cfg=dict(devices=["cpu", "cpu"], pack_size=2,
                                                       micro_batch_size=1, optimizer_sharding="replicate"))),
}


def _moment_bytes(spec: dict, world: int, rank: int, sharded: bool,
                  on_device: frozenset[int] = frozenset()) -> int:
    """Bytes of AdamW moments a rank should hold: every layer's, or its ceil(n/R) shard of each
    (a layer stepped on its device, ``on_device``, keeps whole moments there)."""
    from _dist_worker import make

    from tinypipe.distributed.shards import Shard
    from tinypipe.lora.hooks import split_peft
    from tinypipe.models.decompose import Decomposition

    layers = Decomposition(split_peft(make(spec))[1]).layers
    sizes = [Shard(s.train_numel, world, rank).numel if sharded and i not in on_device else s.train_numel
             for i, s in enumerate(layers)]
    return 8 * sum(sizes)


@pytest.mark.parametrize("name", list(CASES))
def test_replicas_equal_one_process(name: str, tmp_path: Path) -> None:
    world, spec = CASES[name]
    results = run(spec, world, tmp_path)
    assert_exact(spec, results)
    lanes = results[0]["trace"]
    assert "dev0:collective" in lanes, lanes  # the reductions are a lane of the schedule
    sharded = spec["cfg"]["optimizer_sharding"] == "shard"
    for rank, r in enumerate(results):  # sharded: 1/R of the moments per rank (4 + 8/R B/param)
        assert r["rss_optimizer"] == _moment_bytes(spec, world, rank, sharded)



def _planner_sharding(spec: dict, budget: int) -> str | None:
    """What the planner chooses for 2 replicas of ``spec`` with ``budget`` bytes of host memory
    (None: nothing fits)."""
    from _dist_worker import make

    import tinypipe
    from tinypipe.lora.hooks import split_peft
    from tinypipe.models.decompose import Decomposition
    from tinypipe.planner.auto import resolve_plan

    model = make(spec)
    dec = Decomposition(split_peft(model)[1])
    cfg = tinypipe.Config(devices=["cpu"], cpu_memory_bytes=budget, **spec["cfg"])
    try:
        plan, _ = resolve_plan(model, cfg, num_blocks=dec.num_blocks, tied=dec.tied, replicas=2)
    except tinypipe.PlanDoesNotFitError:
        return None
    return plan.optimizer_sharding


def test_auto_sharding_at_run_time_is_the_planners_choice(tmp_path: Path) -> None:
    """``optimizer_sharding="auto"`` with the workload given: the ranks ask the planner (here, on a
    CPU whose host AdamW is the slow part, sharding halves it and fits: "shard"; without the
    workload "auto" replicates) -- and training stays exact."""
    from _dist_worker import SEQ

    spec = dict(family="llama", batch=6, steps=2,
                cfg=dict(seq_len=SEQ, global_batch=6, max_grad_norm=0.5, optimizer_sharding="auto"))
    budget = 16 << 30
    assert _planner_sharding(spec, budget) == "shard"
    spec["cfg"]["cpu_memory_bytes"] = budget
    results = run(spec, 2, tmp_path)
    assert [r["sharding"] for r in results] == ["shard", "shard"]
    assert_exact(spec, results)
    from tinypipe.schedule.plan import Plan

    plan = Plan.from_json(results[0]["plan"])
    on_device = frozenset().union(*(plan.device_optimized(d) for d in range(plan.num_devices)))
    for rank, r in enumerate(results):
        assert r["plan"] == results[0]["plan"]
        assert r["rss_optimizer"] == _moment_bytes(spec, 2, rank, True, on_device)
