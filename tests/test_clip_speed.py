"""Clipping at speed: the clipped time model (the deferred host AdamW racing the next forward), the
search keeping more on the GPU under clipping, and the clip coefficient passed into the fused
AdamW as ``grad_scale`` staying exact against plain PyTorch (``clip_grad_norm_`` + AdamW)."""

from __future__ import annotations

import pytest
import torch
import transformers

from benchkit.workloads import WORKLOADS
from model_zoo import make_batch, make_model
from reference import compare, randomize_biases, train_both, train_reference
from tinypipe.planner.candidate import evaluate
from tinypipe.planner.clipped import RaceUpload, race_forward_end
from tinypipe.planner.clipped_step import CLIPPED_ADAMW_EFFICIENCY
from tinypipe.planner.hardware import load_hardware
from tinypipe.planner.search import plan_for
from tinypipe.planner.sizes import model_sizes
from tinypipe.planner.work import DEVICE_ADAMW_S_PER_PARAM, DOWNLOAD_BYTES, UPLOAD_BYTES
from tinypipe.schedule.plan import make_plan

GIB = 2**30
LR, EPS, WD = 1e-3, 1e-6, 0.1

# ------------------------------------------------------------------------- the race, by hand


def _two_packs(host_s: float) -> list[RaceUpload]:
    """Embedding, pack 0 (two layers), the head, pack 1 (two layers): every layer ``host_s``
    seconds of host AdamW at 1 element/s and 0.5 s of upload at 1 byte/s."""
    n = int(host_s * 10)  # elements at adamw_rate=10/s
    return [RaceUpload(0, None, n, 5, gates_forward=True), RaceUpload(0, 0, n, 5), RaceUpload(0, 0, n, 5),
            RaceUpload(0, None, n, 5), RaceUpload(0, 1, n, 5), RaceUpload(0, 1, n, 5)]


def test_race_bound_by_the_host_pass() -> None:
    """Updates of 1 s each, uploads of 0.5 s, forwards of 2 s per pack, 3 slots.
    host pass: embed 1, a 2, b 3, head 4, c 5, d 6.  uploads: embed 1-1.5, a 2-2.5, b 3-3.5,
    head 4-4.5; pack 0's forward 3.5-5.5 (frees its slots at 5.5); c 5-5.5 (a free third slot),
    d 6-6.5 (a's slot, free since 5.5); pack 1's forward max(5.5, 6.5) + 2 = 8.5."""
    r = race_forward_end(_two_packs(1.0), [2.0, 2.0], slots=3, devices=1, h2d=10.0, adamw_rate=10.0)
    assert r.forward_end_s == pytest.approx(8.5) and r.host_pass_s == pytest.approx(6.0)
    assert r.uploads_end_s == pytest.approx(6.5)


@pytest.mark.parametrize("slots,end", [(3, 6.1), (2, 6.6)])
def test_race_bound_by_the_slots(slots: int, end: float) -> None:
    """Updates of 0.1 s: embed up 0.1-0.6, a 0.6-1.1, b 1.1-1.6, head 1.6-2.1; pack 0 forward
    1.6-3.6. With 3 slots c takes the free one (2.1-2.6) and d waits for pack 0's (3.6-4.1):
    pack 1 runs 4.1-6.1. With 2 slots c waits too (3.6-4.1), d follows (4.1-4.6): 4.6-6.6."""
    r = race_forward_end(_two_packs(0.1), [2.0, 2.0], slots=slots, devices=1, h2d=10.0, adamw_rate=10.0)
    assert r.forward_end_s == pytest.approx(end)


def test_race_resident_packs_take_no_host_time() -> None:
    """A resident pack 0 (no uploads, stepped on the device) runs at once; pack 1's two layers are
    the whole host pass (0.2 + 0.2 s, uploads 0.5 s each): 0.2-0.7, 0.7-1.2; its forward
    max(2.0, 1.2) + 2 = 4.0 -- the resident pack's forward hides the pass."""
    ups = [RaceUpload(0, 1, 2, 5), RaceUpload(0, 1, 2, 5)]
    r = race_forward_end(ups, [2.0, 2.0], slots=3, devices=1, h2d=10.0, adamw_rate=10.0)
    assert r.forward_end_s == pytest.approx(4.0) and r.host_pass_s == pytest.approx(0.4)


def _w1():
    w = WORKLOADS["W1"]
    return w, model_sizes(transformers.LlamaConfig(**w.config))


def test_clipped_step_of_a_streamed_plan_by_hand() -> None:
    """W1, pack 1 / micro-batch 4 / window 1 / host stash / embedding on the GPU, h200-pcie5: the
    host pass (every block and the final norm at the clipped rate) is slower than the uploads
    (7 ms a block) and the forward (15 ms a block), so the forward ends one upload and one block
    forward after the pass; then the head, the backward (no host AdamW in it) and the last
    gradient chunk; the embedding's step on the GPU last."""
    w, sizes = _w1()
    hw = load_hardware("h200-pcie5").with_memory(24 * GIB)
    plan = make_plan(sizes.num_blocks, pack_size=1, micro_batch_size=4, backward_micro_batch_size=4,
                     num_devices=1, prefetch_window=1, stash="host", tied=True, device_optimizer="embed")
    t = evaluate(sizes, hw, plan, seq=w.seq, global_batch=w.batch, max_grad_norm=1.0).time
    assert t.forward_limit == "compute" and t.backward_limit == "compute"
    trains = sizes.layer_train_numels
    rate = hw.cpu_adamw_gparams_s * 1e9 * CLIPPED_ADAMW_EFFICIENCY
    host_pass = sum(trains[1:]) / rate  # blocks + the final norm (the tied head); the embedding is on the GPU
    last_upload = trains[-2] * UPLOAD_BYTES / (hw.h2d_gbs * 1e9)
    last_forward = t.forward_s / sizes.num_blocks  # uniform packs, compute-bound forward
    last_chunk = sizes.grad_slot_numel * DOWNLOAD_BYTES / (hw.d2h_gbs * 1e9)
    expected = (host_pass + last_upload + last_forward + t.head_s + t.backward_s + last_chunk
                + trains[0] * DEVICE_ADAMW_S_PER_PARAM)
    assert t.clipped_step_s == pytest.approx(expected, rel=1e-9)
    assert t.clipped_step_s > t.step_s + 0.3  # the pass is the slow path (0.38 s slower with the 0.838 rate)


def test_resident_packs_shorten_the_clipped_step_by_their_host_pass() -> None:
    """Each resident block takes its host update out of the race: the clipped step shrinks by
    about its share of the pass, while the unclipped step barely moves."""
    w, sizes = _w1()
    hw = load_hardware("h200-pcie5").with_memory(24 * GIB)
    times = []
    for r in (0, 4):
        plan = make_plan(sizes.num_blocks, pack_size=1, micro_batch_size=4, backward_micro_batch_size=4,
                         num_devices=1, prefetch_window=1, stash="host", tied=True, device_optimizer="embed",
                         resident_packs=r)
        times.append(evaluate(sizes, hw, plan, seq=w.seq, global_batch=w.batch, max_grad_norm=1.0).time)
    per_block = sizes.layer_train_numels[1] / (hw.cpu_adamw_gparams_s * 1e9 * CLIPPED_ADAMW_EFFICIENCY)
    saved = times[0].clipped_step_s - times[1].clipped_step_s
    assert saved == pytest.approx(4 * per_block, rel=0.25)
    assert abs(times[0].step_s - times[1].step_s) < 0.5 * saved


# ----------------------------------------------------------------------------------- the search


def test_search_steps_more_on_the_gpu_under_clipping() -> None:
    """W1 under 24 GiB: without clipping the fastest plan keeps at most its first two one-block
    packs resident (the host lane's last work, planner/host_lane.py: 1 until attention's backward
    was priced at its own FLOP ratio, 2 since, 1 % faster predicted); under clipping the search ranks by the
    clipped step and steps more blocks on the GPU (resident packs, assisted layers), which is
    faster in a clipped step than the unclipped choice; a tighter GPU steps fewer there."""
    w, sizes = _w1()
    kw = dict(gpus=1, cpu_memory_bytes=128 * GIB, seq=w.seq, global_batch=w.batch)
    cfg = transformers.LlamaConfig(**w.config)
    plain = plan_for(cfg, "h200-pcie5", gpu_memory_bytes=24 * GIB, **kw)
    clip = plan_for(cfg, "h200-pcie5", gpu_memory_bytes=24 * GIB, max_grad_norm=1.0, **kw)
    assert plain.best.plan.resident_packs <= 2
    def stepped_on_gpu(p) -> int:  # blocks a clipped step updates on the GPU
        return sum(len(p.packs[q]) for q in range(p.resident_packs)) + len(p.assisted)

    assert stepped_on_gpu(clip.best.plan) > stepped_on_gpu(plain.best.plan) + 4
    assert clip.best.plan.resident_packs > 0 and clip.best.gpu_need <= 24 * GIB
    assert clip.seconds() == clip.best.time.clipped_step_s
    again = evaluate(sizes, plain.hardware, plain.best.plan, seq=w.seq, global_batch=w.batch,
                     max_grad_norm=1.0)
    assert clip.best.time.clipped_step_s < 0.95 * again.time.clipped_step_s
    tight = plan_for(cfg, "h200-pcie5", gpu_memory_bytes=16 * GIB, max_grad_norm=1.0, **kw)
    assert tight.best.gpu_need <= 16 * GIB
    assert stepped_on_gpu(tight.best.plan) < stepped_on_gpu(clip.best.plan)
    assert tight.best.time.clipped_step_s > clip.best.time.clipped_step_s


# ----------------------------------------------------------- exactness of the grad_scale path


CASES = {
    "one_device": dict(devices=["cpu"], pack_size=1, micro_batch_size=2),
    "two_devices_host_stash": dict(devices=["cpu"] * 2, pack_size=2, micro_batch_size=3,
                                   backward_micro_batch_size=2, stash="host"),
    "resident_embed_on_device": dict(devices=["cpu"], pack_size=[1, 2, 1], micro_batch_size=2,
                                     resident_packs=1, device_optimizer="embed"),
    "two_devices_resident": dict(devices=["cpu"] * 2, pack_size=1, micro_batch_size=2, resident_packs=1,
                                 stash="host"),
}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("case", list(CASES))
def test_grad_scale_clipping_matches_pytorch(family: str, case: str) -> None:
    """Six steps with a threshold between the steps' norms: some clip, some do not (speculation,
    rollback, deferral and redo all run); every step's loss and norm and the final weights match
    torch's clip_grad_norm_ + AdamW."""
    model = make_model(family, layers=4)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [make_batch(5, 12, seed=i) for i in range(6)]
    norms = sorted(train_reference(model, batches, lr=LR, eps=EPS, weight_decay=WD).grad_norms)
    threshold = (norms[2] + norms[3]) / 2
    engine, ref = train_both(model, model, batches, dict(CASES[case], max_grad_norm=threshold), lr=LR,
                             eps=EPS, weight_decay=WD)
    clipped = [n + 1e-6 > threshold for n in ref.grad_norms]
    assert 0 < sum(clipped) < len(clipped)
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    engine.close()


def test_grad_scale_step_equals_scaling_first() -> None:
    """ChunkedAdamW.step with grad_scale = 1/coef against the gradient multiplied by coef first:
    the same update to float rounding, and the scaled gradient is written back into ``grad``."""
    from tinypipe.memory.host_store import LayerState
    from tinypipe.models.decompose import LayerKind, LayerSpec, ParamSlice
    from tinypipe.runtime.optim.adamw import ChunkedAdamW

    n, coef = 10_000, 0.37
    g = torch.Generator().manual_seed(0)
    p, m, v, grad = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3, \
        torch.rand(n, generator=g) * 1e-6, torch.randn(n, generator=g) * 1e-3
    spec = LayerSpec(1, LayerKind.BLOCK, "x", [ParamSlice("w", (n,), 0, n)], n)
    a = LayerState(spec, p.clone(), m.clone(), v.clone())
    b = LayerState(spec, p.clone(), m.clone(), v.clone())
    opt = ChunkedAdamW(1e-3, (0.9, 0.999), 1e-8, 0.1)
    ga, gb = grad.clone().mul_(coef), grad.clone()
    opt.step(a, 0, n, ga, 3, 1e-3)
    opt.step(b, 0, n, gb, 3, 1e-3, grad_scale=torch.tensor(1 / coef, dtype=torch.float32))
    torch.testing.assert_close(gb, ga, rtol=2e-7, atol=0)
    for x, y in ((a.master, b.master), (a.exp_avg, b.exp_avg), (a.exp_avg_sq, b.exp_avg_sq)):
        # near-zero moments (beta1 * m and the new gradient term nearly cancel) differ by a
        # rounding of the larger terms: compare against the buffer's scale
        torch.testing.assert_close(y, x, rtol=1e-6, atol=2e-7 * float(x.abs().max()))
    assert not torch.equal(gb, grad)
