"""Assisted updates (``Plan.assisted``): a clipped step's leftover AdamW updates of the chosen layers
run on the device at the layer's next upload (tinypipe/runtime/optim/assist.py).

On CPU the "device" step is the same fused AdamW on copies, so an assisted engine must equal the
unassisted one bit for bit (and plain PyTorch to float rounding) -- with clipping every step,
chunks smaller than a layer (so the decay groups' offsets inside a chunk matter), several devices,
a checkpoint taken while updates are still pending, and ``nonfinite="skip"`` (which defers every
update, clipped or not).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from reference import assert_steps_match, compare, randomize_biases, train_reference
from tinypipe.errors import ConfigError
from tinypipe.runtime.optim import assist as assist_module
from tinypipe.runtime.optim.assist import AssistedUpdates
from tinypipe.schedule.ids import download_id
from tinypipe.schedule.plan import Plan

LR, EPS, WD = 1e-3, 1e-6, 0.1
CLIP = 1e-3  # every step exceeds it, from the first layer's norm on: every update is deferred


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 704 elements: every layer of the tiny models spans several, and the three chunk
    buffers are reused many times per layer. A multiple of 64, as the real 4 Mi-element chunk: the
    fused kernel's vector lanes then group the elements as one whole-layer call does (700 gives
    last-bit differences: elements in the scalar tail round differently)."""
    monkeypatch.setattr(assist_module, "ASSIST_CHUNK_NUMEL", 704)


@pytest.fixture
def device_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The layers whose update ran as an assisted (device) update, in order."""
    ran: list[int] = []
    real = AssistedUpdates.run

    def counted(self, item, dev, dst):  # type: ignore[no-untyped-def]
        ran.append(item.layer)
        return real(self, item, dev, dst)

    monkeypatch.setattr(AssistedUpdates, "run", counted)
    return ran


def _engine(family: str, cfg: dict, assisted: tuple[int, ...]) -> tinypipe.Engine:
    """An engine for a fresh ``family`` model on ``cfg``'s own plan with ``assisted`` added."""
    config = tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD, head_chunk_tokens=7, **cfg)
    probe = tinypipe.Engine(_fresh(family), config)
    plan = replace(probe.plan, assisted=assisted)
    probe.close()
    return tinypipe.Engine(_fresh(family), config, plan=plan)


#: (family, hand-set knobs, assisted layers): every family, 1-2 devices, uneven packs, host stash,
#: kept activations, a device-stepped head and a resident pack beside the assisted layers
SCHEDULES = [
    ("llama", dict(devices=["cpu"], pack_size=1, micro_batch_size=2), (0, 2, 3, 5)),
    ("gpt2", dict(devices=["cpu"] * 2, pack_size=2, micro_batch_size=3, backward_micro_batch_size=2,
                  stash="host"), (1, 2, 3, 4, 5)),
    ("mistral", dict(devices=["cpu"], pack_size=[1, 3], micro_batch_size=5, prefetch_window=2), (0, 4)),
    ("qwen2", dict(devices=["cpu"], pack_size=2, micro_batch_size=2, keep_activations=True), (1, 3, 4)),
    ("qwen3", dict(devices=["cpu"] * 2, pack_size=1, micro_batch_size=2, device_optimizer="head"), (1, 2, 3)),
    ("opt", dict(devices=["cpu"], pack_size=2, micro_batch_size=2, resident_packs=1), (3, 4, 5)),
]


def _bit_identical(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(state) == set(expected)
    for k in expected:
        assert torch.equal(state[k], expected[k]), k


def _fresh(family: str, layers: int = 4) -> torch.nn.Module:
    model = make_model(family, layers=layers)
    randomize_biases(model)
    return model


@pytest.mark.parametrize("family,cfg,assisted", SCHEDULES)
def test_assisted_updates_equal_the_host_pass_bit_for_bit(small_chunks: None, device_runs: list[int],
                                                          family: str, cfg: dict,
                                                          assisted: tuple[int, ...]) -> None:
    # seeds 5-9: with 0-4, OPT's reference passes 1.8e-8 from a ReLU kink at step 2 (KINK_MARGIN)
    batches = [make_batch(5, 12, seed=i) for i in range(5, 10)]
    cfg = dict(cfg, max_grad_norm=CLIP)
    init_model = _fresh(family)
    init = {k: v.clone() for k, v in init_model.state_dict().items()}
    ref = train_reference(init_model, batches, lr=LR, eps=EPS, weight_decay=WD, max_grad_norm=CLIP)

    plain = tinypipe.Engine(_fresh(family), tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD,
                                                            head_chunk_tokens=7, **cfg))
    plain_results = [plain.step(b) for b in batches]
    engine = _engine(family, cfg, assisted)
    assert engine.plan.assisted == tuple(sorted(assisted))
    results = [engine.step(b) for b in batches]
    assert_steps_match(results, ref, CLIP)
    assert all(r.clipped for r in results)
    # the head's norm alone exceeds CLIP, so no step speculates: the updates of steps 1-4 ran
    # assisted at the uploads of steps 2-5
    assert sorted(device_runs) == sorted(list(assisted) * 4), str(device_runs)
    assert set(engine.optimizer.assist.pending) == set(assisted)  # step 5's wait for a next upload
    assert [r.loss for r in results] == [r.loss for r in plain_results]
    state, plain_state = engine.state_dict(), plain.state_dict()  # drains the pending ones on the host
    assert not engine.optimizer.assist.pending
    _bit_identical(state, plain_state)
    worst, update_err = compare(state, ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    engine.close()
    plain.close()


def test_an_unassisted_engine_is_what_the_bit_identity_is_checked_against(device_runs: list[int]) -> None:
    """The comparison above must be able to fail: an assisted update that skipped the clip
    coefficient (stepping the raw gradient) moves the weights off the unassisted engine's."""
    batches = [make_batch(5, 12, seed=i) for i in range(3)]
    cfg = dict(devices=["cpu"], pack_size=1, micro_batch_size=5, max_grad_norm=CLIP)
    plain = tinypipe.Engine(_fresh("llama"), tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD,
                                                             head_chunk_tokens=7, **cfg))
    for b in batches:
        plain.step(b)
    engine = _engine("llama", cfg, (2,))
    real_take = AssistedUpdates.take

    def unclipped(self, work, deferred, lr):  # type: ignore[no-untyped-def]
        return real_take(self, work, {k: (1.0, s) for k, (_, s) in deferred.items()}, lr)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AssistedUpdates, "take", unclipped)
        for b in batches:
            engine.step(b)
    assert device_runs == [2, 2]  # steps 1 and 2's updates, wrongly unclipped on the device
    name = next(k for k in plain.state_dict() if ".layers.1." in k)
    assert not torch.equal(engine.state_dict()[name], plain.state_dict()[name])
    engine.close()
    plain.close()


def test_nonfinite_skip_defers_every_update_and_assists_it(device_runs: list[int]) -> None:
    """``nonfinite="skip"`` retains gradients and never speculates: every step's updates are
    leftover work, clipped or not -- and assisted ones equal plain PyTorch (no clipping here)."""
    batches = [make_batch(4, 10, seed=i) for i in range(4)]
    model = _fresh("qwen2")
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ref = train_reference(model, batches, lr=LR, eps=EPS, weight_decay=WD)
    engine = _engine("qwen2", dict(devices=["cpu"], pack_size=2, micro_batch_size=2,
                                          nonfinite="skip"), (1, 3, 4))
    results = [engine.step(b) for b in batches]
    assert_steps_match(results, ref, None)
    assert sorted(device_runs) == sorted([1, 3, 4] * 3)
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    engine.close()


@pytest.mark.parametrize("clip", [CLIP, None], ids=["pending_leftover", "after_backward"])
def test_a_checkpoint_with_pending_updates_resumes_bit_identically(tmp_path, small_chunks: None,
                                                                   clip: float | None) -> None:
    batches = [make_batch(5, 12, seed=i) for i in range(4)]
    cfg = dict(devices=["cpu"], pack_size=2, micro_batch_size=5, max_grad_norm=clip)
    straight = _engine("llama", cfg, (1, 2, 5))
    for b in batches:
        straight.step(b)
    first = _engine("llama", cfg, (1, 2, 5))
    for b in batches[:2]:
        first.step(b)
    assert bool(first.optimizer.assist.pending) == (clip is not None)  # the save must apply them first
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    resumed = _engine("llama", cfg, (1, 2, 5))
    resumed.load_checkpoint(tmp_path / "ckpt")
    for b in batches[2:]:
        resumed.step(b)
    _bit_identical(resumed.state_dict(), straight.state_dict())
    straight.close()
    resumed.close()


def test_an_evaluation_between_steps_runs_the_pending_updates_and_sees_them(small_chunks: None,
                                                                           device_runs: list[int]) -> None:
    """An evaluation's uploads claim the pending updates (stepped on the way up, as a step's
    would): its loss is the unassisted engine's, and training goes on bit-identically."""
    batches = [make_batch(5, 12, seed=i) for i in range(4)]
    cfg = dict(devices=["cpu"], pack_size=1, micro_batch_size=2, max_grad_norm=CLIP)
    plain = tinypipe.Engine(_fresh("gpt2"), tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD,
                                                            head_chunk_tokens=7, **cfg))
    engine = _engine("gpt2", cfg, (1, 3, 5))
    for e in (plain, engine):
        for b in batches[:2]:
            e.step(b)
    assert engine.optimizer.assist.pending == {1, 3, 5}
    held_out = make_batch(3, 12, seed=99)
    assert engine.evaluate(held_out).loss == plain.evaluate(held_out).loss
    assert sorted(device_runs) == [1, 1, 3, 3, 5, 5]  # step 2's, by the evaluation's uploads
    for e in (plain, engine):
        for b in batches[2:]:
            e.step(b)
    _bit_identical(engine.state_dict(), plain.state_dict())
    engine.close()
    plain.close()


def test_the_scratch_exists_only_where_updates_are_assisted() -> None:
    for cfg in (dict(max_grad_norm=1.0), {}):  # leftover work; stepped after the backward
        engine = _engine("llama", dict(devices=["cpu"] * 2, pack_size=2, micro_batch_size=5, **cfg), (1,))
        for d in engine.devices:
            cats = d.pool.bytes_by_category()
            assert cats["assist_scratch"] == 4 * 4 * assist_module.ASSIST_CHUNK_NUMEL * 3
        assert engine.optimizer.steps_after_backward(1) == (not cfg)
        engine.close()
    engine = _engine("llama", dict(devices=["cpu"], pack_size=2, micro_batch_size=5), ())
    assert engine.optimizer.assist is None
    assert "assist_scratch" not in engine.devices[0].pool.bytes_by_category()
    engine.close()


@pytest.fixture
def backward_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The layers stepped on their device right after their backward, in order."""
    ran: list[int] = []
    real = AssistedUpdates.step_after_backward

    def counted(self, layer, *args):  # type: ignore[no-untyped-def]
        ran.append(layer)
        return real(self, layer, *args)

    monkeypatch.setattr(AssistedUpdates, "step_after_backward", counted)
    return ran


@pytest.mark.parametrize("family,cfg,assisted", SCHEDULES)
def test_unclipped_layers_stepped_after_their_backward_equal_the_host_bit_for_bit(
        small_chunks: None, backward_runs: list[int], family: str, cfg: dict,
        assisted: tuple[int, ...]) -> None:
    """No clipping: the assisted layers are stepped by their download, the host steps the rest."""
    batches = [make_batch(5, 12, seed=i, pad=i == 1) for i in range(4)]
    init_model = _fresh(family)
    init = {k: v.clone() for k, v in init_model.state_dict().items()}
    ref = train_reference(init_model, batches, lr=LR, eps=EPS, weight_decay=WD)
    plain = tinypipe.Engine(_fresh(family), tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD,
                                                            head_chunk_tokens=7, **cfg))
    plain_results = [plain.step(b) for b in batches]
    engine = _engine(family, cfg, assisted)
    results = [engine.step(b) for b in batches]
    assert_steps_match(results, ref, None)
    assert sorted(backward_runs) == sorted(list(assisted) * len(batches))
    assert [r.loss for r in results] == [r.loss for r in plain_results]
    assert [s.step for s in engine.store.layers] == [len(batches)] * len(engine.store.layers)
    state, plain_state = engine.state_dict(), plain.state_dict()
    _bit_identical(state, plain_state)
    moments, plain_moments = engine.optimizer_state(), plain.optimizer_state()
    for k in plain_moments:
        assert torch.equal(moments[k]["exp_avg_sq"], plain_moments[k]["exp_avg_sq"]), k
    worst, update_err = compare(state, ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    engine.close()
    plain.close()


def test_a_nonfinite_gradient_is_skipped_by_the_device_and_the_layers_it_did_step_are_named(
        backward_runs: list[int]) -> None:
    """Block 2's gradient is made infinite: its assisted step must leave it as it was; block 1's
    (assisted, finite, stepped by the device before the host saw block 2's norm) took the update
    and the error says so, as it does for the host-stepped layers before it."""
    engine = _engine("llama", dict(devices=["cpu"], pack_size=1, micro_batch_size=5), (1, 2, 4))
    engine.step(make_batch(5, 12, seed=0))
    before = [s.master.clone() for s in engine.store.layers]

    def fault(task) -> None:  # type: ignore[no-untyped-def]
        if task.id == download_id(2):
            engine.devices[0].pool.grads(2, task.grad_slots[0])[0] = float("inf")

    engine.fault = fault
    with pytest.raises(tinypipe.NonFiniteError) as info:
        engine.step(make_batch(5, 12, seed=1))
    text = str(info.value)
    assert "non-finite gradients of block.1" in text, text
    assert "head, block.3, block.2, block.0 already took this step's update" in text, text
    engine.optimizer.synchronize()
    after = engine.store.layers
    unchanged = [torch.equal(s.master, b) for s, b in zip(after, before)]
    assert unchanged == [True, False, True, False, False, False]  # the embedding and block 1
    assert [s.step for s in after] == [1, 2, 1, 2, 2, 2]
    assert backward_runs[-3:] == [4, 2, 1]


def test_the_plan_refuses_layers_that_cannot_be_assisted() -> None:
    from tinypipe.schedule.plan import make_plan

    plan = make_plan(4, pack_size=1, micro_batch_size=1, backward_micro_batch_size=1, num_devices=1,
                     prefetch_window=1, stash="device", tied=False)
    assert replace(plan, assisted=(3, 1, 1)).assisted == (1, 3)
    assert Plan.from_json(replace(plan, assisted=(2,)).to_json()).assisted == (2,)
    for bad, why in (((7,), "must be in 0..5"), ((True,), "must be in 0..5")):
        with pytest.raises(ConfigError, match=why):
            replace(plan, assisted=bad)
    with pytest.raises(ConfigError, match="stepped on its device"):
        replace(plan, resident_packs=1, assisted=(1,))
    with pytest.raises(ConfigError, match="stepped on its device"):
        replace(plan, device_optimizer="embed", assisted=(0,))
    with pytest.raises(ConfigError, match="state on the SSD"):
        replace(plan, offload=((2, "moments"),), assisted=(2,))
    with pytest.raises(ConfigError, match="one pipeline"):
        replace(plan, replicas=2, assisted=(2,))


@pytest.mark.gpu
@pytest.mark.parametrize("clip", [CLIP, None], ids=["clipped_leftover", "after_backward"])
@pytest.mark.parametrize("cfg,tol", [
    (dict(devices=["cuda:0"], pack_size=1, micro_batch_size=2, prefetch_window=2, stash="host",
          compile_blocks="off"), 1e-5),
    (dict(devices=["cuda:0", "cuda:0"], pack_size=[1, 2, 1], micro_batch_size=2, backward_micro_batch_size=3,
          precision="bf16"), 2e-3),
], ids=["fp32_1dev_host_stash", "bf16_2x_same_gpu"])
def test_cuda_assisted_updates_match_the_host_pass(small_chunks: None, device_runs: list[int],
                                                   backward_runs: list[int], cfg: dict, tol: float,
                                                   clip: float | None) -> None:
    """On CUDA the device's fused AdamW replaces the CPU's: equal to float rounding -- in fp32 within
    1e-5 of the update (measured on an H200: 1.3-1.6e-6 after four steps, the two kernels rounding
    differently; bench/results/s8_assist8_W1_s8.log); in bf16 a 1-ulp master difference can flip a weight's bf16 cast and move later
    gradients, hence 2e-3. An update that read stale weights, skipped the clip coefficient or
    raced its downloads is off by the order of the update itself."""
    torch.backends.cuda.matmul.allow_tf32 = False
    batches = [make_batch(5, 12, seed=i) for i in range(4)]
    cfg = dict(cfg, max_grad_norm=clip)
    init = {k: v.clone() for k, v in _fresh("llama").state_dict().items()}
    plain = tinypipe.Engine(_fresh("llama"), tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD,
                                                             head_chunk_tokens=7, **cfg))
    with plain:  # closed (its page-locked memory released) even when an assertion fails
        plain_results = [plain.step(b) for b in batches]
        plain_state = {k: v.clone() for k, v in plain.state_dict().items()}
    with _engine("llama", cfg, (0, 2, 3, 5)) as engine:
        results = [engine.step(b) for b in batches]
        state = {k: v.clone() for k, v in engine.state_dict().items()}
    assert all(r.clipped for r in results) == (clip is not None)
    ran = device_runs if clip is not None else backward_runs
    assert sorted(ran) == sorted([0, 2, 3, 5] * (3 if clip is not None else 4))
    # the step's link traffic counts the state's round trips (12 B/param each way beyond the plain run)
    assert results[-1].h2d_bytes > plain_results[-1].h2d_bytes
    assert results[-1].d2h_bytes > plain_results[-1].d2h_bytes
    diff = sum(float(((state[k] - plain_state[k]) ** 2).sum()) for k in state) ** 0.5
    delta = sum(float(((plain_state[k] - init[k]) ** 2).sum()) for k in state) ** 0.5
    assert diff <= tol * delta, (diff, delta)
