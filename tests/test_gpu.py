"""CUDA runs of the equivalence check and a bf16 smoke test (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from reference import compare, randomize_biases, train_reference

pytestmark = pytest.mark.gpu

LR, EPS, WD = 1e-3, 1e-6, 0.1


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
@pytest.mark.parametrize("cfg", [
    dict(devices=["cuda:0"], pack_size=1, micro_batch_size=2, prefetch_window=2, stash="host",
         device_optimizer="embed", resident_packs=2),
    dict(devices=["cuda:0", "cuda:0"], pack_size=[1, 2, 1], micro_batch_size=2, backward_micro_batch_size=3,
         max_grad_norm=0.5, device_optimizer="both"),
    dict(devices=["cuda:0"], pack_size=2, micro_batch_size=5, prefetch_window=1, max_grad_norm=0.5,
         pin_memory="pageable", compile_blocks="off"),
    # streamed packs 1 and 2 keep compact compiled graphs, their backward in other slots (window 2)
    dict(devices=["cuda:0"], pack_size=1, micro_batch_size=2, prefetch_window=2, stash="host",
         keep_activations=[False, True, True, False], max_grad_norm=0.5),
    # the micro-batch-wise turn through the last 2 packs (compiled), pack 0 streamed and kept
    dict(devices=["cuda:0"], pack_size=1, micro_batch_size=2, prefetch_window=1, stash="host",
         keep_activations=[True, False, True, True], turn_packs=2, max_grad_norm=0.5),
], ids=["1dev_host_stash_embed_and_2_packs_on_gpu", "2x_same_gpu_clip_both_on_gpu", "pageable_clip_eager",
        "streamed_kept_compiled", "turn_compiled"])
def test_cuda_fp32_matches_pytorch(family: str, cfg: dict) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = make_model(family)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [make_batch(5, 12, seed=i, pad=i == 1) for i in range(3)]
    ref = train_reference(model, batches, lr=LR, eps=EPS, weight_decay=WD,
                          max_grad_norm=cfg.get("max_grad_norm"))
    with tinypipe.Engine(model, tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD, **cfg)) as engine:
        results = [engine.step(b) for b in batches]
        for r, loss in zip(results, ref.losses):
            assert abs(r.loss - loss) <= 1e-5 * abs(loss)
        worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)


def test_compiling_blocks_starts_no_worker_processes() -> None:
    """Inductor compiles in-process, the backward graph included (lowered lazily it compiled in
    autograd's device thread with a pool of one worker process per core: +6.9 GB host RSS)."""
    import psutil

    model = make_model("llama", layers=2)
    with tinypipe.Engine(model, tinypipe.Config(devices=["cuda:0"], precision="bf16", pack_size=1,
                                                micro_batch_size=3, compile_blocks="inductor")) as engine:
        engine.step(make_batch(3, 40, seed=5))  # a shape no other test compiles
    assert engine.compile_backend == "inductor"
    children = psutil.Process().children(recursive=True)
    assert not children, [c.cmdline()[:3] for c in children]


def test_cuda_bf16_loss_falls() -> None:
    model = make_model("llama", layers=4)
    batch = make_batch(8, 32, seed=0)
    cfg = tinypipe.Config(devices=["cuda:0"], precision="bf16", lr=3e-3, micro_batch_size=2, pack_size=2,
                          stash="host")
    with tinypipe.Engine(model, cfg) as engine:
        losses = [engine.step(batch).loss for _ in range(8)]
        report = engine.memory_report()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5, losses
    assert report.device_peaks["0:cuda:0"]["peak_allocated"] > 0


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_two_gpus_fp32_match_pytorch(family: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_model(family, layers=6)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [make_batch(5, 12, seed=i, pad=i == 1) for i in range(3)]
    ref = train_reference(model, batches, lr=LR, eps=EPS, weight_decay=WD, max_grad_norm=0.5)
    cfg = tinypipe.Config(devices=["cuda:0", "cuda:1"], pack_size=[1, 2, 2, 1], micro_batch_size=2,
                          backward_micro_batch_size=3, stash="host", max_grad_norm=0.5, lr=LR, eps=EPS,
                          weight_decay=WD)
    with tinypipe.Engine(model, cfg) as engine:
        results = [engine.step(b) for b in batches]
        for r, loss in zip(results, ref.losses):
            assert abs(r.loss - loss) <= 1e-5 * abs(loss)
        worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cuda_lora_fp32_matches_peft(family: str) -> None:
    """LoRA on CUDA (frozen base uploaded from its own buffer, blocks compiled): exact vs PEFT."""
    from test_lora import run_both as lora_run_both

    torch.backends.cuda.matmul.allow_tf32 = False
    engine = lora_run_both(family, dict(devices=["cuda:0"], pack_size=2, micro_batch_size=2,
                                        backward_micro_batch_size=3, stash="host", max_grad_norm=0.05))
    engine.close()


@pytest.mark.parametrize("scheme", ["nf4", "fp4"])
@pytest.mark.parametrize("cfg", [
    dict(devices=["cuda:0"], pack_size=2, micro_batch_size=2, backward_micro_batch_size=3, prefetch_window=2,
         stash="host", max_grad_norm=0.05),
    dict(devices=["cuda:0"], pack_size=[1, 2, 1], micro_batch_size=2, backward_micro_batch_size=3,
         max_grad_norm=100.0, resident_packs=1, device_optimizer="both"),
    dict(devices=["cuda:0"], pack_size=1, micro_batch_size=5, compile_blocks="off", pin_memory="pageable"),
    dict(devices=["cuda:0", "cuda:0"], pack_size=[1, 2, 1], micro_batch_size=2, backward_micro_batch_size=3,
         stash="host", max_grad_norm=0.05),
    pytest.param(dict(devices=["cuda:0", "cuda:1"], pack_size=[1, 2, 1], micro_batch_size=2,
                      backward_micro_batch_size=3, stash="host", max_grad_norm=0.05),
                 marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")),
], ids=["1dev_packs2_host_stash_clip", "1dev_resident_pack", "1dev_eager_pageable", "2x_same_gpu", "2gpus"])
def test_cuda_qlora_fp32_matches_peft_bitsandbytes(scheme: str, cfg: dict) -> None:
    """QLoRA on CUDA: the quantized payload uploaded into the slots and rebuilt there as bitsandbytes'
    parameters; every step and the adapters equal PEFT + bitsandbytes + torch AdamW on the same GPU
    with the same quantized modules (tolerances as on CPU: 1e-5 per step and per adapter tensor)."""
    from test_qlora import run_both as qlora_run_both

    from tinypipe.quant import QuantSpec

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    spec = QuantSpec(scheme, double_quant=scheme == "nf4", compute_dtype=torch.float32)
    qlora_run_both("llama", spec, dict(cfg), ref_device="cuda:0").close()


def test_cuda_qlora_bf16_loss_falls_and_memory_is_packed() -> None:
    from test_qlora import qlora_model

    from tinypipe.quant import QuantSpec

    pm = qlora_model("llama", QuantSpec("nf4"), layers=4)
    batch = make_batch(8, 32, seed=0)
    config = tinypipe.Config(devices=["cuda:0"], precision="bf16", lr=3e-3, micro_batch_size=2, pack_size=2,
                             stash="host")
    with tinypipe.Engine(pm, config) as engine:
        losses = [engine.step(batch).loss for _ in range(8)]
        report = engine.memory_report()
        store = engine.store
    assert all(torch.isfinite(torch.tensor(losses)))
    # adapters start at B = 0 and lr 3e-3 moves them slowly: measured on an H200 4.591 -> 4.518 in
    # 6 steps; every step must lower the loss, by 0.05 in all
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.05, losses
    assert store.frozen_label == "frozen_weights (nf4+dq)"
    assert report.host[store.frozen_label] == store.frozen_bytes


def test_cuda_int8_qlora_is_refused_in_one_line() -> None:
    """int8 (LLM.int8()) on CUDA: its gradient norm missed PEFT + bitsandbytes by 4.2e-5 relative on an
    H200 (session 5), over the 1e-5 tolerance: refused at engine construction, not mid-step."""
    from test_qlora import qlora_model

    from tinypipe.quant import QuantizeError, QuantSpec

    pm = qlora_model("llama", QuantSpec("int8"), layers=2)  # bf16 compute
    with pytest.raises(QuantizeError, match="int8 QLoRA is verified on the CPU only"):
        tinypipe.Engine(pm, tinypipe.Config(devices=["cuda:0"], precision="bf16", pack_size=1,
                                            micro_batch_size=2))


@pytest.mark.xfail(strict=True, reason=(
    "answered on the H200 at 698da54 (bench/results/acceptance/698da54): step by step, the first "
    "step already misses -- 1dev_clip: adapter update 1.14e-4 relative (tolerance 1e-4), "
    "2dev_host_stash: one adapter 3.2e-5 (1e-5) -- so int8 QLoRA stays refused on CUDA; a pass here "
    "(strict) says the refusal could go"))
@pytest.mark.parametrize("cfg", [
    dict(devices=["cuda:0"], pack_size=2, micro_batch_size=2, prefetch_window=2, max_grad_norm=0.05),
    dict(devices=["cuda:0", "cuda:0"], pack_size=2, micro_batch_size=2, stash="host"),
], ids=["1dev_clip", "2dev_host_stash"])
def test_cuda_int8_qlora_matches_step_by_step(cfg: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether the refusal above can go: the 4.2e-5 was measured over a whole run against a
    whole-batch reference, where one flipped int8 activation code moves the norm by up to 3.1e-4
    (tests/test_qlora.py). Compared step by step from the engine's adapters in its micro-batches
    (run_int8_step_by_step, fp32 compute), with the refusal switched off for this test only."""
    from test_qlora import run_int8_step_by_step

    import tinypipe.quant.hooks as hooks
    from tinypipe.quant.spec import check_device

    monkeypatch.setattr(hooks, "check_device",
                        lambda scheme, device: None if getattr(scheme, "scheme", scheme) == "int8"
                        else check_device(scheme, device))
    run_int8_step_by_step(cfg, ref_device="cuda")


