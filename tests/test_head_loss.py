"""The head's elementwise part (models/head_loss.py): the eager path, its row blocks, the fused
graph Inductor compiles, the chunk sizing the planner's bound rests on, and the fallback when
compiling fails. CPU runs compile with Inductor's C++ backend (seconds for these shapes); the
``gpu`` tests compare the compiled CUDA path with the eager one and measure its memory."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import tinypipe.models.head_loss as head_loss
from tinypipe.models.head import chunk_tokens_for, fused_head_chunk
from tinypipe.models.head_loss import (IGNORE, HeadLoss, eager_loss_grad_, fused_loss_grad_,
                                       logit_bytes, logit_data_bytes)

needs_cxx = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                               reason="Inductor's CPU backend needs a C++ compiler")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def _case(tokens: int, vocab: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, vocab, generator=g) * 3).to(device, dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[::5] = IGNORE
    labels = labels.to(device)
    denom = float(tokens + 3)
    scale = (labels != IGNORE).to(torch.float32) / denom
    return logits, labels, denom, scale


def _pytorch(logits: torch.Tensor, labels: torch.Tensor, denom: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: loss and d loss / d logits through autograd (fp32)."""
    lf = logits.detach().float().requires_grad_(True)
    loss = F.cross_entropy(lf, labels, ignore_index=IGNORE, reduction="sum") / denom
    (grad,) = torch.autograd.grad(loss, [lf])
    return loss.detach(), grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_matches_pytorch(dtype: torch.dtype) -> None:
    logits, labels, denom, scale = _case(37, 1000, dtype)
    ref_loss, ref_grad = _pytorch(logits, labels, denom)
    g = logits.clone()
    loss = eager_loss_grad_(g, labels, scale) / denom
    assert g.dtype == dtype
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    if dtype == torch.float32:
        assert torch.allclose(g, ref_grad, rtol=1e-5, atol=1e-9)
    else:  # the fp32 gradient, rounded once to bf16 (half an ulp: 2^-9 relative)
        assert ((g.float() - ref_grad).abs() <= 2**-8 * ref_grad.abs() + 1e-12).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 37])
def test_row_blocks_change_no_result(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                    tokens: int) -> None:
    """Every operation is per row: the whole chunk in one block (the code before the row blocks)
    gives bit for bit what the blocks give."""
    logits, labels, _, scale = _case(tokens, 501, dtype)
    blocked = logits.clone()
    loss_blocked = eager_loss_grad_(blocked, labels, scale)
    monkeypatch.setattr(head_loss, "EAGER_ROW_BLOCKS", 1)
    whole = logits.clone()
    loss_whole = eager_loss_grad_(whole, labels, scale)
    assert torch.equal(loss_blocked, loss_whole) and torch.equal(blocked, whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_graph_is_the_eager_arithmetic(dtype: torch.dtype) -> None:
    """Run eagerly, the graph given to Inductor computes exactly what the eager path does."""
    logits, labels, _, scale = _case(37, 1000, dtype)
    a, b = logits.clone(), logits.clone()
    assert torch.equal(fused_loss_grad_(a, labels, scale), eager_loss_grad_(b, labels, scale))
    assert torch.equal(a, b)


def test_all_rows_ignored_give_zero() -> None:
    logits, labels, _, scale = _case(9, 100, torch.bfloat16)
    labels[:] = IGNORE
    scale = torch.zeros_like(scale)
    g = logits.clone()
    assert eager_loss_grad_(g, labels, scale).item() == 0.0
    assert not g.any()


def _compare_compiled(tokens: int, vocab: int, dtype: torch.dtype, device: str) -> None:
    logits, labels, _, scale = _case(tokens, vocab, dtype, device=device)
    fused = HeadLoss("inductor", cuda_only=False)
    assert fused.uses_compiled(logits.device)
    a, b = logits.clone(), logits.clone()
    loss_c = fused(a, labels, scale)
    loss_e = eager_loss_grad_(b, labels, scale)
    assert fused.failed is None
    assert torch.allclose(loss_c, loss_e, rtol=2e-6, atol=0)
    # the same fp32 numbers up to reordering and exp's implementation (CUDA: Triton's ex2-based exp,
    # ~1e-6 relative at the exponents here), then one rounding to the compute dtype (bf16: one ulp)
    ulp = 2**-7 if dtype == torch.bfloat16 else 1e-5
    diff = (a.float() - b.float()).abs()
    assert (diff <= ulp * b.float().abs() + 1e-12).all(), diff.max()


@needs_cxx
def test_compiled_matches_eager_on_cpu() -> None:
    """Inductor's C++ backend: within float rounding of the eager path, one graph per chunk
    shape (a chunk and a tail), compiled once and reused."""
    _compare_compiled(64, 1000, torch.bfloat16, "cpu")
    torch._dynamo.reset()
    counters.clear()
    fused = HeadLoss("inductor", cuda_only=False)
    for tokens in (64, 64, 24, 64, 24):
        logits, labels, _, scale = _case(tokens, 1000, torch.bfloat16, seed=tokens)
        fused(logits, labels, scale)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


@needs_cxx
def test_a_failed_compile_runs_eager_with_one_warning(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No working compiler (Inductor's own error, a fresh cache so nothing compiled is reused):
    the chunk runs eager -- same result -- with one warning, and later chunks stay eager."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.fspath(tmp_path))
    logits, labels, _, scale = _case(16, 300, torch.bfloat16)
    fused = HeadLoss("inductor", cuda_only=False)
    a, b = logits.clone(), logits.clone()
    with inductor_config.patch({"cpp.cxx": (None, os.fspath(tmp_path / "no-such-compiler"))}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = fused(a, labels, scale)
            fused(logits.clone(), labels, scale)
    assert fused.failed is not None and "compiler" in fused.failed.lower()
    assert [str(w.message) for w in caught if "fused head loss" in str(w.message)] == [
        f"tinypipe: the fused head loss did not compile ({fused.failed}); running it eager"]
    assert torch.equal(loss, eager_loss_grad_(b, labels, scale)) and torch.equal(a, b)
    assert not fused.uses_compiled(torch.device("cpu"))


def test_only_inductor_on_cuda_compiles() -> None:
    """Other backends would run the fused graph op by op, with fp32 temporaries of the whole chunk."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert HeadLoss("inductor").uses_compiled(cuda)
    assert not HeadLoss("inductor").uses_compiled(cpu)
    assert not HeadLoss("aot_eager").uses_compiled(cuda)
    assert not HeadLoss(None).uses_compiled(cuda)
    assert HeadLoss("inductor", cuda_only=False).uses_compiled(cpu)


@pytest.mark.parametrize("vocab", [100, 1000, 32000, 50257, 128256, 151936, 256000])
def test_chunks_fill_the_budget(vocab: int) -> None:
    """A chunk's logit bytes fit 512 MiB, and one more token would not (unless clamped to the
    64..8192 range); the planner's bound adds the small vectors and the allocator's rounding."""
    budget = 512 * 1024**2
    chunk = chunk_tokens_for(vocab)
    assert 64 <= chunk <= 8192
    assert logit_data_bytes(chunk, vocab, 2) <= budget or chunk == 64
    assert logit_data_bytes(chunk + 1, vocab, 2) > budget or chunk == 8192
    assert 0 < logit_bytes(chunk, vocab, 2) - logit_data_bytes(chunk, vocab, 2) <= 5 * 2**20
    # no fp32 copy of the whole chunk any more: twice the tokens of the 6 B/logit sizing
    assert chunk >= min(8192, 2 * (budget // (vocab * 6)) - 8)


class _Norm(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(hidden) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


def _head_case(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, device: str = "cpu"):
    torch.manual_seed(0)
    norm = _Norm(hidden).to(device, dtype)
    lm_head = nn.Linear(hidden, vocab, bias=False).to(device, dtype)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    labels[::3] = IGNORE
    return norm, lm_head, x, labels


def _head_reference(norm: nn.Module, lm_head: nn.Module, x: torch.Tensor, labels: torch.Tensor,
                    denom: float) -> tuple[torch.Tensor, ...]:
    xr = x.detach().requires_grad_(True)
    loss = F.cross_entropy(lm_head(norm(xr)).float(), labels, ignore_index=IGNORE, reduction="sum") / denom
    gx, gn, gw = torch.autograd.grad(loss, [xr, norm.weight, lm_head.weight])
    return loss.detach(), gx, gn, gw


def _head_fused(norm: nn.Module, lm_head: nn.Module, x: torch.Tensor, labels: torch.Tensor, denom: float,
                loss_grad) -> tuple[torch.Tensor, ...]:
    loss, gx, (gn,), gw = fused_head_chunk([norm], lm_head, x, labels, denom, [norm.weight], None,
                                           loss_grad=loss_grad)
    return loss, gx, gn, gw


def _close(got: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...], rtol: float) -> None:
    for name, a, b in zip(("loss", "d hidden", "d norm", "d weight"), got, ref):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err <= rtol, f"{name}: relative error {err:.2e}"


def test_fused_head_chunk_matches_autograd_fp32() -> None:
    norm, lm_head, x, labels = _head_case(29, 64, 500, torch.float32)
    _close(_head_fused(norm, lm_head, x, labels, 31.0, HeadLoss(None)),
           _head_reference(norm, lm_head, x, labels, 31.0), 1e-6)


@needs_cxx
def test_fused_head_chunk_compiled_matches_autograd_fp32() -> None:
    norm, lm_head, x, labels = _head_case(29, 64, 500, torch.float32)
    fused = HeadLoss("inductor", cuda_only=False)
    ref = _head_reference(norm, lm_head, x, labels, 31.0)
    _close(_head_fused(norm, lm_head, x, labels, 31.0, fused), ref, 1e-6)
    assert fused.failed is None


# ----------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_compiled_matches_eager(dtype: torch.dtype) -> None:
    _compare_compiled(1392, 128256 // 8, dtype, "cuda")


@pytest.mark.gpu
def test_cuda_compiled_writes_over_the_logits() -> None:
    """The fused path needs no fp32 buffer of the chunk: its peak on top of the logits stays far
    below one fp32 row block, so the planner's :func:`logit_bytes` bounds both paths."""
    vocab = 128256
    tokens = chunk_tokens_for(vocab)
    logits, labels, _, scale = _case(tokens, vocab, torch.bfloat16, device="cuda")
    fused = HeadLoss("inductor")
    fused(logits.clone(), labels, scale)  # compile
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fused(logits, labels, scale)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert fused.failed is None
    assert extra < tokens * vocab, f"{extra / 2**20:.1f} MiB on top of the logits"
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    g = logits.clone()
    eager_loss_grad_(g, labels, scale)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= logit_bytes(tokens, vocab, 2) + 2**20
