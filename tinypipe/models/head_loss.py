"""The head's elementwise part: a token chunk's logits -> the summed token loss, and in place of
the logits d loss / d logits (softmax minus one-hot, times each row's weight).

Eager, this is a dozen kernels over an fp32 copy of the logits (``.float()``, logsumexp and its
fp32 temporary, gather, sub/exp, scatter, mul, the cast back): about 34 bytes of memory traffic
per logit. In a traced H200 step (W1 = Llama-3.2-3B shape, 32768 tokens x 128256 logits, 1.827 s)
the head task took 0.226 s, of which its three matmuls (3 x 25.8 TFLOP) account for ~0.10-0.13 s
at the ~700 TFLOP/s measured; the rest was this elementwise work. Inductor fuses the same arithmetic
(:func:`fused_loss_grad_`) into one pass reading the bf16 logits twice and writing the gradient
over them (~6 B/logit, no fp32 buffer of the chunk's size); it reorders only float operations.

The eager path (:func:`eager_loss_grad_`, the engine's code before the fused one, and what runs on
CPU or without Inductor) does its fp32 work in :data:`EAGER_ROW_BLOCKS` row blocks, so neither
path holds more than the logits themselves plus one block's fp32 copy
(:func:`logit_bytes`, the planner's bound); every operation is per row, so the blocks change
no result.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch

IGNORE = -100

#: Row blocks of the eager path's fp32 work: each block's fp32 copy and logsumexp's fp32
#: temporary (8 B/logit) are 1/8 of the chunk's rows, i.e. 1 B per logit of the chunk on top of
#: its bf16 logits.
EAGER_ROW_BLOCKS = 8

#: ``(logits, labels, scale) -> loss sum``, overwriting ``logits`` with d loss / d logits.
LossGrad = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def logit_bytes(tokens: int, vocab: int, elem: int) -> int:
    """Device bytes the head's logits of ``tokens`` tokens need at most (``elem``: bytes per
    element of the compute dtype): the logits, overwritten by their gradient, plus the eager
    path's fp32 row block (its copy and logsumexp's temporary; the fused path needs neither), the
    per-token vectors (label, mask, logsumexp, picked logit) and the CUDA caching allocator's
    rounding of the two block-sized buffers up to 2 MiB each: on an H200 the eager path's peak at
    W1's chunk was 1.8 MiB above the block bytes alone."""
    return logit_data_bytes(tokens, vocab, elem) + tokens * 24 + 2 * ALLOCATOR_ROUNDING


def logit_data_bytes(tokens: int, vocab: int, elem: int) -> int:
    """The logits and the eager path's fp32 row block alone (what a chunk is sized by)."""
    rows = -(-tokens // EAGER_ROW_BLOCKS)
    return tokens * vocab * elem + rows * vocab * 8


ALLOCATOR_ROUNDING = 2 * 2**20  # large CUDA caching-allocator blocks come in multiples of 2 MiB


def eager_loss_grad_(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Sum over valid rows of ``logsumexp - logit[label]``; ``logits`` becomes d loss / d logits
    with row ``i`` scaled by ``scale[i]`` (0 for ignored rows). fp32 arithmetic in row blocks."""
    n = logits.shape[0]
    valid = labels != IGNORE
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    picked = torch.empty_like(lse)
    step = max(1, -(-n // EAGER_ROW_BLOCKS))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        block = logits[r0:r1]
        lf = block.float()  # a view when the logits are fp32 already
        idx = safe[r0:r1, None]
        lse_b = torch.logsumexp(lf, dim=-1)
        picked[r0:r1] = lf.gather(1, idx).squeeze(1)
        lse[r0:r1] = lse_b
        lf.sub_(lse_b[:, None]).exp_()
        lf.scatter_add_(1, idx, -torch.ones_like(lf[:, :1]))
        lf.mul_(scale[r0:r1, None])
        if lf.data_ptr() != block.data_ptr():
            block.copy_(lf)
        del lf
    return ((lse - picked) * valid).sum()


def fused_loss_grad_(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """:func:`eager_loss_grad_` as one expression graph for Inductor: the same fp32 arithmetic
    (``p - 1`` at the label where eager adds ``-1``: the same number), no scatter, no in-place
    steps before the final write, so the whole of it fuses into one pass over the logits."""
    lf = logits.float()
    valid = labels != IGNORE
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    lse = torch.logsumexp(lf, dim=-1)
    picked = lf.gather(1, safe[:, None]).squeeze(1)
    loss = ((lse - picked) * valid).sum()
    p = torch.exp(lf - lse[:, None])
    cols = torch.arange(lf.shape[1], device=lf.device)
    g = torch.where(cols[None, :] == safe[:, None], p - 1.0, p) * scale[:, None]
    logits.copy_(g)
    return loss


class HeadLoss:
    """The head's loss and logit gradient, fused by Inductor on CUDA, eager elsewhere.

    ``backend``: the engine's torch.compile backend for its blocks (None: eager). Only Inductor
    fuses; any other backend would run :func:`fused_loss_grad_` op by op, materialising fp32
    temporaries of the whole chunk, so it runs eager. Compiled lazily on the first CUDA call,
    one static graph per chunk shape (the full chunk and a micro-batch's tail), under the
    blocks' settings (models/compiled.py: no compile worker processes). A compile that fails,
    or more shapes than the recompile limit, switches to the eager path for good with one
    warning, instead of Dynamo running the fused graph eager (which holds those temporaries).
    ``cuda_only=False`` compiles on CPU too (Inductor's C++ backend; tests).
    """

    def __init__(self, backend: str | None, cuda_only: bool = True) -> None:
        self.backend = backend if backend == "inductor" else None
        self.cuda_only = cuda_only
        self._compiled: LossGrad | None = None
        self.failed: str | None = None  # why compiling failed (then eager for good)

    def uses_compiled(self, device: torch.device) -> bool:
        """Whether a chunk on ``device`` runs the compiled graph."""
        return self.backend is not None and self.failed is None and (
            device.type == "cuda" or not self.cuda_only)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if not self.uses_compiled(logits.device):
            return eager_loss_grad_(logits, labels, scale)
        from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

        from tinypipe.models.compiled import compile_settings

        # per call, in the calling thread: the settings are thread-local (as for the blocks)
        with compile_settings(self.backend), _raise_on_failure():
            if self._compiled is None:
                self._compiled = torch.compile(fused_loss_grad_, backend=self.backend, fullgraph=True,
                                               dynamic=False)
            try:
                return self._compiled(logits, labels, scale)
            except (TorchDynamoException, FailOnRecompileLimitHit) as exc:  # raised before it ran
                self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        warnings.warn(f"tinypipe: the fused head loss did not compile ({self.failed}); "
                      "running it eager", RuntimeWarning, stacklevel=2)
        return eager_loss_grad_(logits, labels, scale)


def _raise_on_failure() -> contextlib.AbstractContextManager:
    """Dynamo settings under which a failed compile raises instead of running the graph eager."""
    cfg = torch._dynamo.config
    patch = {"suppress_errors": False}
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        patch["fail_on_recompile_limit_hit"] = True
    return cfg.patch(**patch)
