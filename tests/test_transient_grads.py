"""Transient embedding/head gradient accumulators at long sequences (schedule/transient_grads.py,
issue #32): which layers qualify, the schedule's wait, the engine's pool after a step, bit-identical
training against the pool-held accumulators, and the planner's estimate that prices them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tinypipe
import tinypipe.runtime.build as runtime_build
import tinypipe.schedule.builder as schedule_builder
from model_zoo import make_batch, make_model
from reference import randomize_biases
from tinypipe.schedule.builder import build_schedule
from tinypipe.schedule.ids import bwd_id, download_id
from tinypipe.schedule.plan import Plan
from tinypipe.schedule.transient_grads import transient_grad_layers
from tinypipe.schedule.validate import validate

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PLAN = Plan(packs=((0, 1), (2, 3)), micro_batch_size=2, backward_micro_batch_size=3, fwd_device=(0, 0),
            bwd_device=(0, 0), stash_on_host=(False, False, False))
HEAD = PLAN.num_blocks + 1


def test_which_layers_are_transient() -> None:
    """Only at long sequences; the embedding not under a tied head; neither where something else
    holds the gradient past its download (a turn, an assisted update, AdamW on the device)."""
    assert transient_grad_layers(PLAN, tied=False, long_sequences=False) == frozenset()
    assert transient_grad_layers(PLAN, tied=False, long_sequences=True) == {0, HEAD}
    assert transient_grad_layers(PLAN, tied=True, long_sequences=True) == {HEAD}
    assert transient_grad_layers(dataclasses.replace(PLAN, device_optimizer="head"), False, True) == {0}
    assert transient_grad_layers(dataclasses.replace(PLAN, device_optimizer="both"), False, True) == frozenset()
    assert transient_grad_layers(dataclasses.replace(PLAN, assisted=(1,)), False, True) == frozenset()
    turn = dataclasses.replace(PLAN, backward_micro_batch_size=2, turn_packs=1, keep_activations=(False, True))
    assert transient_grad_layers(turn, False, True) == frozenset()


def test_the_first_backward_waits_for_the_heads_download() -> None:
    """At long sequences the last pack's first backward micro-batch depends on ``dl/L<head>`` (so
    the head's accumulator is gone before a block backward allocates); short runs keep the
    overlap. Both schedules validate."""
    long_sched = build_schedule(PLAN, 5, tied=False, long_sequences=True)
    short_sched = build_schedule(PLAN, 5, tied=False)
    validate(long_sched)
    validate(short_sched)
    last = PLAN.num_packs - 1
    assert download_id(HEAD) in long_sched.tasks[bwd_id(last, 0)].deps
    assert download_id(HEAD) not in short_sched.tasks[bwd_id(last, 0)].deps
    assert download_id(HEAD) not in long_sched.tasks[bwd_id(last, 1)].deps  # once is enough


def _engine(family: str, transient: bool, monkeypatch: pytest.MonkeyPatch, **over: object) -> tinypipe.Engine:
    if not transient:  # the same long-sequence engine, the accumulators held in the pool
        none = lambda *a, **k: frozenset()  # noqa: E731
        monkeypatch.setattr(runtime_build, "transient_grad_layers", none)
        monkeypatch.setattr(schedule_builder, "transient_grad_layers", none)
    model = make_model(family)
    randomize_biases(model)
    cfg = dict(devices=["cpu"], pack_size=2, micro_batch_size=2, backward_micro_batch_size=3,
               mlp_chunk_tokens=5, lr=1e-3, eps=1e-6, weight_decay=0.1, head_chunk_tokens=7)
    cfg.update(over)
    engine = tinypipe.Engine(model, tinypipe.Config(**cfg))
    monkeypatch.undo()
    return engine


@pytest.mark.parametrize("family,over", [("llama", {}), ("qwen2", {}), ("llama", {"max_grad_norm": 0.05})],
                         ids=["untied", "tied", "untied_clipped"])
def test_transient_accumulators_train_bit_identically(family: str, over: dict,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Three steps with the accumulators allocated per phase and freed after their download give
    the same losses, gradient norms and weights, bit for bit, as with them held in the pool; after
    each step the pool holds none of them (an engine that kept them fails here)."""
    batches = [make_batch(5, 16, seed=i, pad=i == 1) for i in range(3)]
    held = _engine(family, False, monkeypatch, **over)
    free = _engine(family, True, monkeypatch, **over)
    tied = free.decomposition.tied
    head = held.plan.num_blocks + 1
    want = {head} if tied else {0, head}
    pool = free.devices[0].pool
    assert pool.transient_grads == want and not held.devices[0].pool.transient_grads
    for b in batches:
        r1, r2 = held.step(b), free.step(b)
        assert (r1.loss, r1.grad_norm, r1.clipped) == (r2.loss, r2.grad_norm, r2.clipped)
        assert not want & set(pool.resident_grads), "a transient accumulator outlived its download"
    if "max_grad_norm" in over:
        assert r2.clipped
    s1, s2 = held.state_dict(), free.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    cats_held = held.devices[0].pool.bytes_by_category()["gradient_accumulators"]
    cats_free = pool.bytes_by_category()["gradient_accumulators"]
    layers = free.decomposition.layers
    freed = sum(4 * layers[layer].train_numel for layer in want)
    assert cats_held - cats_free == freed > 0
    held.close()
    free.close()


def test_the_estimate_moves_the_accumulators_into_their_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's estimate at long sequences: the static gradient accumulators less exactly the
    transient ones (what the engine's pool then holds), and the activation peak grows by no more
    than them (each is counted in its own phase, not in every phase)."""
    import tinypipe.planner.estimate as estimate
    from tinypipe.planner.sizes import model_sizes

    sizes = model_sizes(make_model("llama").config)
    trains = sizes.layer_train_numels
    both = 4 * (trains[0] + trains[-1])
    kw = dict(batch=5, seq=16, precision="fp32", devices=["cpu"], mlp_chunk=5)
    free = estimate.estimate_memory(sizes, PLAN, **kw).devices["0:cpu"]
    monkeypatch.setattr(estimate, "transient_grad_layers", lambda *a, **k: frozenset())
    held = estimate.estimate_memory(sizes, PLAN, **kw).devices["0:cpu"]
    assert held["gradient_accumulators"] - free["gradient_accumulators"] == both > 0
    grew = free["activations_peak"] - held["activations_peak"]
    assert 0 <= grew <= 4 * max(trains[0], trains[-1]) < both


def test_a_long_context_plan_that_only_transient_accumulators_fit() -> None:
    """The Llama-3.1-8B shape, full fine-tuning at 2 x 128K tokens on the SSD tier under a 24 GiB
    cap, attention over whole segments (tiles would fit it anyway): 26.3 GiB GPU with the
    accumulators held, 22.4 GiB with them transient."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import long_context as lc

    a = lc.parse(["--rows", "8b-full-128k-ssd", "--cpu-gib", "128", "--plan-only", "--attention-tile-tokens", "0"])
    p = lc.plan_row(lc.ROWS["8b-full-128k-ssd"], 131072, a)
    assert p["fits"], p.get("reason")
    assert 22.0 * lc.GiB < p["gpu_need"] < 23.0 * lc.GiB


@pytest.mark.gpu
def test_on_cuda_the_accumulators_leave_the_pool_and_train_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (side streams, the caching allocator reusing the freed memory): the same training
    as with pool-held accumulators (losses and weights within 1e-6 relative: attention's backward
    kernels need not be deterministic), and after each step the pool holds neither accumulator."""
    torch.backends.cuda.matmul.allow_tf32 = False
    batches = [make_batch(5, 16, seed=i, pad=i == 1) for i in range(3)]
    over = dict(devices=["cuda:0"], compile_blocks="off")
    held = _engine("llama", False, monkeypatch, **over)
    r1 = [held.step(b) for b in batches]
    s1 = held.state_dict()
    held.close()
    free = _engine("llama", True, monkeypatch, **over)
    pool = free.devices[0].pool
    assert pool.transient_grads == {0, free.plan.num_blocks + 1}
    r2 = []
    for b in batches:
        r2.append(free.step(b))
        assert not pool.transient_grads & set(pool.resident_grads)
    s2 = free.state_dict()
    free.close()
    for a, b in zip(r1, r2):
        assert abs(a.loss - b.loss) <= 1e-6 * abs(a.loss)
    for k, v in s1.items():
        assert float((s2[k] - v).norm()) <= 1e-6 * float(v.norm()), k
