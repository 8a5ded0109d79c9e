"""The planner and kept activations: it keeps packs where the GPU budget leaves room for their
graphs and the time model says it pays, none where it does not (the plan then is today's), the
time model drops exactly the kept packs' recompute, and an explicit choice is honoured."""

from __future__ import annotations

import dataclasses

import pytest
import transformers

import tinypipe
from benchkit.workloads import WORKLOADS
from tinypipe.errors import ConfigError, PlanDoesNotFitError
from tinypipe.planner.cost import predict_step_time
from tinypipe.planner.hardware import load_hardware
from tinypipe.planner.search import plan_for
from tinypipe.planner.sizes import model_sizes
from tinypipe.planner.work import recompute_seconds
from tinypipe.schedule.builder import build_schedule
from tinypipe.schedule.plan import make_plan
from tinypipe.schedule.validate import validate
from tinypipe.units import GIB

W1 = WORKLOADS["W1"]


def _w1(gib: int, **kw) -> tinypipe.planner.search.PlanResult:
    return plan_for(transformers.LlamaConfig(**W1.config), "h200-pcie5", gpus=1, gpu_memory_bytes=gib * GIB,
                    cpu_memory_bytes=200 * GIB, seq=W1.seq, global_batch=W1.batch, **kw)


def _kept(plan) -> list[int]:
    return [q for q in range(plan.num_packs) if plan.kept(q)]


def test_keeps_compact_packs_where_the_gpu_budget_allows() -> None:
    """W1 on an H200 at 24 GiB: compact kept graphs (~2 GB per block for the step) fit for a few
    blocks; the predicted step is faster than without keeping, the plan validates and fits; the
    search never puts kept graphs in host memory (measured slower: bench/RESULTS.md, session 10);
    at 48 GiB more packs keep."""
    tight, tight_off = _w1(24), _w1(24, keep_activations=False)
    plan = tight.best.plan
    kept = _kept(plan)
    assert kept and not plan.kept_on_host
    assert tight.best.time.step_s < tight_off.best.time.step_s
    assert tight.best.gpu_need <= 24 * GIB
    validate(build_schedule(plan, W1.batch, tight.sizes.tied))
    assert "activations kept" in tight.best.describe()
    roomy = _w1(48)
    blocks = lambda p: sum(len(p.packs[q]) for q in _kept(p))  # noqa: E731
    assert blocks(roomy.best.plan) > blocks(plan)
    assert roomy.best.time.step_s < tight.best.time.step_s
    cfg = tinypipe.Config(**{k: v for k, v in roomy.config_kwargs().items() if k != "devices"})
    assert cfg.keep_activations == roomy.best.plan.keep_activations


def test_the_time_model_drops_the_kept_packs_recompute() -> None:
    sizes = model_sizes(transformers.LlamaConfig(**W1.config))
    hw = load_hardware("h200-pcie5")
    plan = make_plan(sizes.num_blocks, pack_size=[1] + [3] * 9, micro_batch_size=4,
                     backward_micro_batch_size=4, num_devices=1, prefetch_window=3, stash="host", tied=sizes.tied, resident_packs=1)
    kept = dataclasses.replace(plan, keep_activations=(True,) + (False,) * 8 + (True,))
    kw = dict(batch=W1.batch, seq=W1.seq, precision="bf16")
    t0, t1 = predict_step_time(sizes, plan, hw, **kw), predict_step_time(sizes, kept, hw, **kw)
    rec = recompute_seconds(sizes, plan, hw, **kw)
    assert t0.compute_s - t1.compute_s == pytest.approx(rec[0] + rec[9], rel=1e-9)
    assert t1.step_s < t0.step_s


def test_an_explicit_choice_is_kept() -> None:
    """``keep_activations=True``: every pack keeps (no recompute at all) -- on a GPU with room for
    all 28 W1 blocks' graphs; at 48 GiB no plan can, and the error says so."""
    forced = _w1(400, keep_activations=True).best.plan
    assert _kept(forced) == list(forced.keepable_packs()) == list(range(forced.num_packs))
    with pytest.raises(ConfigError, match="per-pack"):
        _w1(48, keep_activations=(True, False))
    with pytest.raises(PlanDoesNotFitError, match="keep"):  # a kept W1 block alone is ~4.3 GB
        _w1(48, keep_activations=True)
