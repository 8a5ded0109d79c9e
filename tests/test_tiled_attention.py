"""Tiled attention (``Config.attention_tile_tokens``, issue #32): a segment longer than a tile attends
in tiles of queries x keys through the fused kernel's forward and backward, merged by their
log-sum-exp. In fp64 the output and the gradients equal plain causal softmax attention to 1e-12
(grouped-query heads, ragged last tiles, several rows); the engine trains Llama, Qwen2 and Qwen3 on
packed and padded rows in tiles of 3 tokens exactly as plain PyTorch with transformers' masks; the
planner's estimate counts the tiled backward (and the whole-segment one with tiles off); on CUDA
the tiled backward holds what its count says and less than the whole-segment kernel."""

from __future__ import annotations

import math

import pytest
import torch

import tinypipe
from model_zoo import make_model
from reference import compare, randomize_biases, train_both
from test_segment_attention import CONFIGS, EPS, LR, WD, _batches, _segmented
from tinypipe.models import tiled_attention as ta

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention written out (``[B, Hq, L, D]`` -> ``[B, L, Hq, D]``)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[2]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _inputs(dtype: torch.dtype, device: str = "cpu", batch: int = 2, heads: int = 8, kv_heads: int = 2,
            length: int = 70, dim: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)

    # the layouts transformers hands the attention function: [B, L, H, D] transposed to [B, H, L, D]
    q = rand(batch, length, heads, dim).transpose(1, 2).requires_grad_()
    k = rand(batch, length, kv_heads, dim).transpose(1, 2).requires_grad_()
    v = rand(batch, length, kv_heads, dim).transpose(1, 2).requires_grad_()
    return q, k, v, rand(batch, length, heads, dim)


def _grads(out: torch.Tensor, grad: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, xs, grad))


@pytest.mark.parametrize("tile", [1, 16, 35, 69])
@pytest.mark.parametrize("kv_heads", [8, 2, 1])
def test_tiles_equal_causal_attention_in_fp64(tile: int, kv_heads: int) -> None:
    q, k, v, g = _inputs(torch.float64, kv_heads=kv_heads)
    ref = _reference(q, k, v)
    out = ta.tiled_causal_attention(q, k, v, None, tile=tile)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for got, want in zip(_grads(out, g, q, k, v), _grads(ref, g, q, k, v)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_tiles_in_fp32_and_bf16_stay_within_their_rounding() -> None:
    q64, k64, v64, g64 = _inputs(torch.float64, length=300)
    want = [_reference(q64, k64, v64), *_grads(_reference(q64, k64, v64), g64, q64, k64, v64)]
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 5e-2)):
        q, k, v, g = _inputs(dtype, length=300)
        out = ta.tiled_causal_attention(q, k, v, None, tile=64)
        got = [out, *_grads(out, g, q, k, v)]
        for x, y in zip(got, want):
            assert x.dtype == dtype
            err = (x.double() - y).abs().max().item() / y.abs().max().item()
            assert err < tol, (dtype, err)


def test_a_merge_without_the_log_sum_exp_is_caught() -> None:
    """Sabotage: tiles averaged instead of weighted by their softmax mass -- the fp64 comparison
    above must fail on it."""
    q, k, v, _ = _inputs(torch.float64)
    real = torch.logaddexp
    try:
        ta.torch.logaddexp = lambda a, b: torch.maximum(a, b)  # type: ignore[assignment]
        bad = ta.tiled_causal_attention(q, k, v, None, tile=16)
    finally:
        ta.torch.logaddexp = real  # type: ignore[assignment]
    assert (bad - _reference(q, k, v)).abs().max().item() > 1e-3


def test_where_tiles_apply() -> None:
    q, k, _, _ = _inputs(torch.float32, length=40)
    assert ta.tiles_apply(q, k, 0.0, 16)
    assert not ta.tiles_apply(q, k, 0.0, 40)  # one tile: the whole-segment kernel
    assert not ta.tiles_apply(q, k, 0.0, 0)  # tiles off
    assert not ta.tiles_apply(q, k, 0.1, 16)  # attention dropout: the whole-segment kernel


def _count_tiled_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = ta._forward

    def counting(*args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[2])
        return real(*args)

    monkeypatch.setattr(ta, "_forward", counting)
    return calls


@pytest.mark.parametrize("kind", ["packed", "padded"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_engine_trains_in_tiles_as_pytorch_does(family: str, kind: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments longer than 3 tokens in tiles of 3: losses and norms per step within 1e-5, final
    weights within 1e-5 per tensor and the update within 1e-4 of plain PyTorch with the masks."""
    calls = _count_tiled_calls(monkeypatch)
    model = make_model(family)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = dict(CONFIGS["recompute"], segment_attention=True, attention_tile_tokens=3)
    engine, ref = train_both(model, model, _batches(kind), cfg, lr=LR, eps=EPS, weight_decay=WD)
    assert _segmented(engine) and calls and max(calls) > 3
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    engine.close()


def test_kept_packs_on_two_devices_train_in_tiles_as_pytorch_does(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_tiled_calls(monkeypatch)
    model = make_model("llama")
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = dict(CONFIGS["kept_two_devices"], segment_attention=True, attention_tile_tokens=4)
    engine, ref = train_both(model, model, _batches("packed"), cfg, lr=LR, eps=EPS, weight_decay=WD)
    assert calls
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    engine.close()


def test_compiled_blocks_train_in_tiles_as_pytorch_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled blocks (the attention function and its tile operators stay out of the graphs)."""
    calls = _count_tiled_calls(monkeypatch)
    torch._dynamo.reset()
    model = make_model("qwen2", layers=2)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = dict(devices=["cpu"], pack_size=2, micro_batch_size=3, compile_blocks="aot_eager",
               segment_attention=True, attention_tile_tokens=3)
    engine, ref = train_both(model, model, _batches("packed")[:2], cfg, lr=LR, eps=EPS, weight_decay=WD)
    assert calls
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    engine.close()
    torch._dynamo.reset()


def test_tiles_off_runs_whole_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_tiled_calls(monkeypatch)
    model = make_model("llama")
    engine = tinypipe.Engine(model, tinypipe.Config(**CONFIGS["recompute"], segment_attention=True,
                                                    attention_tile_tokens=0))
    engine.step(_batches("padded")[0])
    engine.close()
    assert not calls
    with pytest.raises(tinypipe.ConfigError, match="attention_tile_tokens"):
        tinypipe.Config(attention_tile_tokens=-1).validate()


def test_the_kernel_check_passes_tiles_and_catches_a_wrong_merge() -> None:
    cpu = torch.device("cpu")
    assert ta.tiles_agree(cpu, torch.bfloat16, "cpu") and ta.tiles_agree(cpu, torch.float32, "cpu")
    assert ta.tile_kernel_for(cpu, torch.float32) == "cpu"
    real = torch.logaddexp
    try:
        ta.torch.logaddexp = lambda a, b: torch.maximum(a, b)  # type: ignore[assignment]
        assert not ta.tiles_agree(cpu, torch.bfloat16, "cpu")
    finally:
        ta.torch.logaddexp = real  # type: ignore[assignment]


def test_sdpas_choice_is_read_where_the_shell_reads_it() -> None:
    """The private entry point the kernel order comes from answers with this torch's signature
    (on the CPU: its flash kernel)."""
    q, k, _, _ = _inputs(torch.bfloat16, length=64, dim=64)
    assert ta.sdpa_choice(q, k) == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


def test_cuda_kernel_choice_takes_the_first_enabled_kernel_that_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    """SDPA's preference first; a kernel that is disabled or disagrees with softmax attention is
    passed over; fp32 has no CUDA tile kernel."""
    tried: list[str] = []

    def agree(device, dtype, kernel):  # type: ignore[no-untyped-def]
        tried.append(kernel)
        return kernel == "flash"

    monkeypatch.setattr(ta, "tiles_agree", agree)
    monkeypatch.setattr(ta, "_kernel_order", lambda device, dtype: ("cudnn", "flash"))
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    cuda = torch.device("cuda")
    assert ta.tile_kernel_for(cuda, torch.bfloat16) == "flash" and tried == ["cudnn", "flash"]
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: False)
    assert ta.tile_kernel_for(cuda, torch.bfloat16) == ""
    assert ta.tile_kernel_for(cuda, torch.float32) == ""


def test_a_shell_attends_whole_where_the_tile_kernels_disagree(monkeypatch: pytest.MonkeyPatch) -> None:
    from tinypipe.models.decompose import Decomposition
    from tinypipe.models.segment_attention import TILE_ATTR
    from tinypipe.models.shell import Shell

    model = make_model("llama")
    shell = Shell(model, Decomposition(model), torch.device("cpu"), segment_attention=True)
    assert getattr(shell.model.config, TILE_ATTR) == ta.ATTENTION_TILE_TOKENS
    monkeypatch.setattr(ta, "tile_kernel_for", lambda device, dtype: "")
    with pytest.warns(RuntimeWarning, match="attend whole"):
        shell = Shell(model, Decomposition(model), torch.device("cpu"), segment_attention=True)
    assert getattr(shell.model.config, TILE_ATTR) == 0


def test_the_estimate_counts_the_tiled_backward() -> None:
    """The 8B shape's attention phase at 256K tokens: ~3.5 rows of the query width per token in
    tiles against 7 whole; the QLoRA row of one 256K sequence plans inside 24 GiB only with tiles."""
    from dataclasses import replace

    from tinypipe.errors import PlanDoesNotFitError
    from tinypipe.planner.estimate import ATTENTION_BACKWARD_ROWS, attention_backward_bytes
    from tinypipe.planner.search import plan_for
    from tinypipe.lora import LoraSettings
    from tinypipe.planner.presets import preset_config
    from tinypipe.planner.sizes import model_sizes

    seq, row = 256 * 1024, 256 * 1024 * 4096 * 2
    cfg = preset_config("llama-3.1-8b")
    cfg.max_position_embeddings = seq
    sizes = model_sizes(cfg)
    whole = attention_backward_bytes(replace(sizes, attention_tile=0), seq, seq, 2)
    assert whole == ATTENTION_BACKWARD_ROWS * row
    tiled = attention_backward_bytes(sizes, seq, seq, 2)
    assert 3 * row < tiled < 4 * row
    short = attention_backward_bytes(sizes, 8192, 8192, 2)  # no tiles at 8K: segment attention off
    assert short == ATTENTION_BACKWARD_ROWS * 8192 * 4096 * 2

    def qlora(tile: int | None):  # -> PlanResult
        return plan_for(cfg, "h200-pcie5", gpus=1, gpu_memory_bytes=24 * 1024**3,
                        cpu_memory_bytes=128 * 1024**3, seq=seq, global_batch=1,
                        lora=LoraSettings(rank=16, alpha=32.0, quantize="nf4", compute_dtype="bf16"),
                        attention_tile_tokens=tile)

    assert qlora(None).best.gpu_need <= 24 * 1024**3
    with pytest.raises(PlanDoesNotFitError):
        qlora(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
@pytest.mark.parametrize("tile", [8192, 32768])  # the smallest and the largest the planner weighs
def test_cuda_tiles_match_sdpa_and_hold_what_the_estimate_counts(kernel: str, tile: int) -> None:
    """bf16, the 8B shape's heads at 128K tokens, each CUDA tile kernel and tile: the tiled output and
    gradients against whole-segment SDPA (bf16 rounding), and each backward's peak above its inputs
    (the output gradient already there): the tiled one within
    :func:`tiled_backward_bytes_per_token` (+64 MiB) -- what the planner sizes plans by, whichever
    tile it chose -- and, with the smallest tile, under the whole-segment one. Larger tiles are
    chosen for speed, not memory: one tile's temporaries grow with the tile (by the count, 0.625
    rows of the query width per token at 8K tiles of a 128K row, 2.5 at 32K), and the
    whole-segment kernel's own peak is not what the planner compares them with."""
    import torch.nn.functional as F

    length = 131072
    cuda = torch.device("cuda")
    chosen = ta.tile_kernel_for(cuda, torch.bfloat16)
    assert chosen  # shells use tiles here, on the kernel SDPA itself would pick
    assert chosen == ta._kernel_order(cuda, torch.bfloat16)[0]
    assert ta.tiles_agree(cuda, torch.bfloat16, kernel)
    q, k, v, g = _inputs(torch.bfloat16, "cuda", batch=1, heads=32, kv_heads=8, length=length, dim=128)

    def backward_peak(fn) -> tuple[list[torch.Tensor], int]:  # type: ignore[no-untyped-def]
        out = fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = list(torch.autograd.grad(out, (q, k, v), g))
        torch.cuda.synchronize()
        return [out.detach(), *grads], torch.cuda.max_memory_allocated() - base

    whole, whole_peak = backward_peak(lambda: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2))
    tiled, tiled_peak = backward_peak(lambda: ta.tiled_causal_attention(q, k, v, None, tile, kernel))
    for x, y in zip(tiled, whole):
        err = (x.float() - y.float()).abs().max().item() / y.float().abs().max().item()
        assert err < 2e-2, err
    bound = ta.tiled_backward_bytes_per_token(32 * 128, 8 * 128, 2, length, tile) * length
    row = length * 32 * 128 * 2
    print(f"{kernel}, tiles of {tile}: backward above its inputs, rows of the query width: whole-segment SDPA "
          f"{whole_peak / row:.2f}, tiled {tiled_peak / row:.2f}, tiled count {bound / row:.2f}")
    assert tiled_peak <= bound + 64 * 1024**2, (tiled_peak, bound)
    if tile == min(ta.ATTENTION_TILE_OPTIONS):
        assert tiled_peak < whole_peak, (tiled_peak, whole_peak)
