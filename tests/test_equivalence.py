"""The core invariant: training through tinypipe equals plain PyTorch training (fp32).

Every family, several packings, micro-batch splits (forward and backward sizes differing),
prefetch windows, stash placements, 1-4 devices, with and without gradient clipping (including
steps where clipping triggers). Losses, gradient norms and weights must match plain
``torch.optim.AdamW`` on the whole model to within 1e-5 relative. The update vector is also
compared (to 1e-4) so a wrong gradient cannot hide behind small learning rates.
"""

from __future__ import annotations

import pytest
import torch

from model_zoo import FAMILIES, make_batch, make_model
from reference import compare, randomize_biases, train_both, train_reference

LR, EPS, WD = 1e-3, 1e-6, 0.1
BATCH, SEQ, STEPS = 5, 12, 3


def run_both(family: str, cfg: dict, tied: bool | None = None, pad: bool = True, layers: int = 4) -> None:
    model = make_model(family, layers=layers, tied=tied)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [make_batch(BATCH, SEQ, seed=i, pad=pad and i == 1) for i in range(STEPS)]
    engine, ref = train_both(model, model, batches, cfg, lr=LR, eps=EPS, weight_decay=WD)
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5, f"max per-tensor relative weight error {worst:.2e}"
    assert update_err <= 1e-4, f"relative error of the update {update_err:.2e}"
    engine.close()


SINGLE = {
    "layerwise": dict(pack_size=1, micro_batch_size=2, prefetch_window=1),
    "packs2_mb23_clip_triggers": dict(pack_size=2, micro_batch_size=2, backward_micro_batch_size=3,
                                      prefetch_window=2, max_grad_norm=0.5),
    "one_pack_host_stash_clip_idle": dict(pack_size=4, micro_batch_size=5, prefetch_window=0,
                                          stash="host", max_grad_norm=100.0),
    "uneven_mb1_window3": dict(pack_size=[3, 1], micro_batch_size=1, backward_micro_batch_size=2,
                               prefetch_window=3, max_grad_norm=1.2),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(SINGLE))
def test_single_device_matches_pytorch(family: str, name: str) -> None:
    run_both(family, dict(devices=["cpu"], **SINGLE[name]))


@pytest.mark.parametrize("family,tied", [("llama", True), ("qwen2", False), ("gpt2", True), ("opt", True)])
def test_tied_and_untied_embeddings(family: str, tied: bool) -> None:
    run_both(family, dict(devices=["cpu"], pack_size=2, micro_batch_size=2, max_grad_norm=0.5), tied=tied)


MULTI = {
    "n2_layerwise": dict(devices=["cpu"] * 2, pack_size=1, micro_batch_size=2, backward_micro_batch_size=3),
    "n3_uneven": dict(devices=["cpu"] * 3, pack_size=[1, 3, 2], micro_batch_size=1,
                      backward_micro_batch_size=2, max_grad_norm=0.5),
    "n4_packs2_host_stash": dict(devices=["cpu"] * 4, pack_size=2, micro_batch_size=3, prefetch_window=2,
                                 stash="host"),
    "n2_packs3_clip_idle": dict(devices=["cpu"] * 2, pack_size=3, micro_batch_size=2,
                                backward_micro_batch_size=1, max_grad_norm=100.0),
    "n3_layerwise_window0": dict(devices=["cpu"] * 3, pack_size=1, micro_batch_size=2, prefetch_window=0),
    "n4_packs4": dict(devices=["cpu"] * 4, pack_size=[2, 4], micro_batch_size=5, backward_micro_batch_size=2),
}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("name", list(MULTI))
def test_multi_device_matches_pytorch(family: str, name: str) -> None:
    run_both(family, dict(MULTI[name]), layers=6)


def test_clipping_triggers_on_some_steps_only() -> None:
    """A threshold between the step norms: some steps clip, some do not, all exact."""
    model = make_model("llama")
    batches = [make_batch(BATCH, SEQ, seed=i) for i in range(STEPS)]
    ref = train_reference(model, batches, lr=LR, eps=EPS, weight_decay=WD)
    norms = sorted(ref.grad_norms)
    threshold = (norms[0] + norms[-1]) / 2
    run_both("llama", dict(devices=["cpu"], pack_size=1, micro_batch_size=2, max_grad_norm=threshold),
             pad=False)


def test_late_clip_rolls_back_speculative_steps_exactly() -> None:
    """A threshold just below step 1's norm: nearly every layer is stepped speculatively, then the
    global norm exceeds it and all are undone and redone (the rollback path); later steps, after a
    clipped one, defer every layer instead. All exact."""
    model = make_model("llama")
    batches = [make_batch(BATCH, SEQ, seed=i) for i in range(STEPS)]
    ref = train_reference(model, batches, lr=LR, eps=EPS, weight_decay=WD)
    late = 0.99 * ref.grad_norms[0]
    run_both("llama", dict(devices=["cpu"], pack_size=1, micro_batch_size=2, max_grad_norm=late), pad=False)


def test_adamw_undo_inverts_the_step() -> None:
    from tinypipe.runtime.optim.adamw import ChunkedAdamW

    class S:  # the LayerState fields the optimizer touches
        pass

    g = torch.Generator().manual_seed(0)
    opt = ChunkedAdamW(1e-3, (0.9, 0.999), 1e-8, 0.1)
    s = S()
    s.master, s.exp_avg, s.exp_avg_sq = torch.randn(1000, generator=g), torch.empty(1000), torch.empty(1000)
    for step in range(1, 6):
        grad = torch.randn(1000, generator=g)
        before = [t.clone() for t in (s.master, s.exp_avg, s.exp_avg_sq)]
        opt.step(s, 0, 1000, grad, step, 1e-3)
        assert not torch.equal(s.master, before[0])
        opt.undo(s, 0, 1000, grad, step, 1e-3)
        for t, b in zip((s.master, s.exp_avg, s.exp_avg_sq), before):
            if step > 1 or t is s.master:
                assert torch.allclose(t, b, rtol=1e-5, atol=1e-7), (step, (t - b).abs().max())
        opt.step(s, 0, 1000, grad, step, 1e-3)  # keep going from the real step
