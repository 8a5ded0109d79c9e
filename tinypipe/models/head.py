"""The head stage: final norm(s) + output embedding + token cross-entropy, forward and backward
fused and chunked over tokens, so full ``[tokens, vocab]`` logits never exist.

For a plain bias-free ``nn.Linear`` output embedding (every supported family) the logit gradient
is formed analytically (softmax minus one-hot) and the weight gradient is accumulated straight
into the fp32 accumulator with one matmul per chunk; on CUDA a bf16 x bf16 -> fp32 GEMM does this
without any bf16 temporary of the weight's size. Other heads fall back to autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100


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
    """Tokens per head chunk so the chunk's logits (+ fp32 copy) stay within ``budget_bytes``."""
    return int(max(64, min(8192, budget_bytes // (vocab * 6))))


def fused_head_chunk(
    post: list[nn.Module],
    lm_head: nn.Module,
    x: torch.Tensor,
    labels: torch.Tensor,
    denom: float,
    post_params: list[torch.Tensor],
    weight_acc: torch.Tensor | None,
    weight_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None], torch.Tensor | None]:
    """Loss (sum over the chunk / ``denom``), d loss / d x, grads of ``post_params``, and -- when
    ``weight_acc`` is None -- the weight gradient (otherwise it was added into ``weight_acc``).
    ``weight_grad=False`` (a frozen output embedding) skips the weight gradient entirely."""
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        h = x
        for m in post:
            h = m(h)
    weight = lm_head.weight
    with torch.no_grad():
        logits = h.detach() @ weight.t()
        lf = logits.float()
        del logits
        valid = labels != IGNORE
        safe = torch.where(valid, labels, torch.zeros_like(labels))
        lse = torch.logsumexp(lf, dim=-1)
        picked = lf.gather(1, safe[:, None]).squeeze(1)
        loss = ((lse - picked) * valid).sum() / denom
        # d loss / d logits = (softmax - onehot) * valid / denom, built in place in lf
        lf.sub_(lse[:, None]).exp_()
        lf.scatter_add_(1, safe[:, None], -torch.ones_like(lf[:, :1]))
        lf.mul_((valid.to(lf.dtype) / denom)[:, None])
        g = lf.to(h.dtype)
        del lf
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
