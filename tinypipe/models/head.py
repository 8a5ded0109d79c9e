"""The head stage: final norm(s) + output embedding + token cross-entropy, forward and backward
fused and chunked over tokens, so full ``[tokens, vocab]`` logits never exist.

For a plain bias-free ``nn.Linear`` output embedding (every supported family) the logit gradient
is formed analytically (softmax minus one-hot) and the weight gradient is accumulated straight
into the fp32 accumulator with one matmul per chunk; on CUDA a bf16 x bf16 -> fp32 GEMM does this
without any bf16 temporary of the weight's size. The elementwise part between the matmuls (loss
and logit gradient) is :mod:`tinypipe.models.head_loss`: fused by Inductor on CUDA, the logit
gradient written over the logits, so a chunk costs its logits' bytes plus at most one fp32 row
block (:func:`~tinypipe.models.head_loss.logit_bytes`) -- chunks are sized by that. Other heads
fall back to autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinypipe.models.head_loss import IGNORE, LossGrad, eager_loss_grad_, logit_data_bytes


def _accumulate_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 and ``a``, ``b`` possibly lower precision."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and _HAS_OUT_DTYPE[0]:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (RuntimeError, TypeError):  # older torch: no bf16 -> fp32 addmm
            _HAS_OUT_DTYPE[0] = False
        acc.add_(a @ b)
    else:
        acc.add_(a @ b)


_HAS_OUT_DTYPE = [True]


def chunk_tokens_for(vocab: int, budget_bytes: int = 512 * 1024**2) -> int:
    """Tokens per head chunk so the chunk's bf16 logits and the eager path's fp32 row block
    (:func:`~tinypipe.models.head_loss.logit_bytes`: 3 B/logit) stay within ``budget_bytes``.
    Before the fused loss a whole fp32 copy of the chunk's logits was made too (6 B/logit: 697
    tokens for a 128256 vocabulary, now 1392); each chunk's weight-gradient matmul reads and writes
    the fp32 weight accumulator (3.2 GB at that vocabulary), so fewer chunks cost less."""
    tokens = budget_bytes // (vocab * 3)
    while tokens > 64 and logit_data_bytes(tokens, vocab, 2) > budget_bytes:  # the row block's rounding
        tokens -= 1
    return int(max(64, min(8192, tokens)))


def fused_head_chunk(
    post: list[nn.Module],
    lm_head: nn.Module,
    x: torch.Tensor,
    labels: torch.Tensor,
    denom: float,
    post_params: list[torch.Tensor],
    weight_acc: torch.Tensor | None,
    weight_grad: bool = True,
    loss_grad: LossGrad = eager_loss_grad_,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None], torch.Tensor | None]:
    """Loss (sum over the chunk / ``denom``), d loss / d x, grads of ``post_params``, and -- when
    ``weight_acc`` is None -- the weight gradient (otherwise it was added into ``weight_acc``).
    ``weight_grad=False`` (a frozen output embedding) skips the weight gradient entirely.
    ``loss_grad``: the elementwise part (a :class:`~tinypipe.models.head_loss.HeadLoss`: fused
    on CUDA; the default is the eager one)."""
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        h = x
        for m in post:
            h = m(h)
    weight = lm_head.weight
    with torch.no_grad():
        g = h.detach() @ weight.t()
        # d loss / d logits = (softmax - onehot) * valid / denom, written over the logits
        scale = (labels != IGNORE).to(torch.float32) / denom
        loss = loss_grad(g, labels, scale) / denom
        grad_h = g @ weight
        wgrad = None
        if not weight_grad:
            pass
        elif weight_acc is not None:
            _accumulate_matmul(weight_acc, g.t(), h.detach())
        else:
            wgrad = g.t() @ h.detach()
        del g
    grads = torch.autograd.grad(h, [x] + post_params, grad_h, allow_unused=True)
    return loss, grads[0], list(grads[1:]), wgrad


def is_plain_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.bias is None and type(module).forward is nn.Linear.forward


def autograd_head_chunk(
    shell_logits, x: torch.Tensor, labels: torch.Tensor, denom: float, params: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    """Generic fallback: autograd through ``shell_logits`` (post modules + output embedding)."""
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        logits = shell_logits(x)
        loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum") / denom
    grads = torch.autograd.grad(loss, [x] + params, allow_unused=True)
    return loss.detach(), grads[0], list(grads[1:])
