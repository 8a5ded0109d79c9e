"""Compact kept graphs: a kept block saves what its matmuls and attention produced, nothing else.

A pack that keeps its activations (``Plan.keep_activations``) holds its forward's saved tensors for
the whole step (every forward micro-batch), so their bytes decide how many blocks can keep.
Autograd saves every input of every op: for a Llama block in bf16 about 24*H + 8*I bytes per token
(fp32 norm inputs, rotary products, SiLU's input and output ...). Most of that is a cheap
elementwise function of a few tensors. :class:`CompactBlock` runs the block under torch's selective
activation checkpointing: the outputs of the matmuls and of scaled-dot-product attention are saved
(:data:`SAVED_OPS`), everything else is recomputed from them in the backward -- norms, rotary,
activations, residual sums: elementwise work, fused into the backward's kernels when the block is
compiled. Per token that is 3*H + 2*KV + 2*I from the matmuls plus the attention output (H) and
its log-sum-exp: for a Llama-3.2-3B block (H 3072, I 8192, KV 1024) 61 KB in bf16 against the full graph's
139 KB.

Measured in the probe (:func:`saved_output_bytes`): the bytes are what the checkpoint's cache holds
in eager mode; compiled, the partitioner keeps at most those (it drops outputs the backward does not
read, like the down projection's). The block's input is saved too (counted by the estimator as the
pack's inner inputs). Only for runs without dropout: the recompute would have to replay the masks.

A *low-rank expansion* is recomputed, not saved: a 2-D matmul whose output is at least
:data:`LOW_RANK_RATIO` times wider than its contraction (LoRA's ``lora_B``: rank r in, the
projection's width out). Saving it would cost as many bytes per token as the base projection's
own output -- a LoRA block on every projection saved 1.9x the full-fine-tuning set at the
Llama-3.1-8B width (361 against 189 KB per token in fp32), which the GPU ran out of memory on
-- while recomputing it costs 2r FLOPs per output element (0.4 % of an 8B block's matmuls at
rank 16). The adapters' ``lora_A`` outputs (r wide) are saved as any matmul's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tinypipe.models.tiled_attention import tiled_attention_op

_aten = torch.ops.aten

#: Ops whose outputs a compact kept block saves: matmuls (FLOPs to avoid recomputing) and fused
#: attention (its log-sum-exp and output are what its backward reads).
SAVED_OPS = frozenset(op for op in (
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    tiled_attention_op._opoverload,
))


#: A 2-D matmul with ``out_width >= LOW_RANK_RATIO * contraction`` is a low-rank expansion
#: (recomputed). Dense projections have ratios <= 4 (an MLP's up projection: I/H ~ 3.5).
LOW_RANK_RATIO = 8
_MATMULS_2D = frozenset((_aten.mm.default, _aten.addmm.default))


def is_low_rank_expansion(op: Any, args: tuple) -> bool:
    """A linear layer's matmul (mm / addmm) whose contraction is narrow against its output: LoRA's
    ``lora_B``. Decided from shapes alone, so eager and compiled blocks (and the probe, which
    runs narrower copies with the same rank: planner/sizes.py keeps the ratio) agree."""
    if op not in _MATMULS_2D:
        return False
    a, b = (args[1], args[2]) if op is _aten.addmm.default else (args[0], args[1])
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != 2 or b.dim() != 2:
        return False
    return b.shape[1] >= LOW_RANK_RATIO * a.shape[1]


def is_saved(op: Any, args: tuple) -> bool:
    """Whether a compact block saves ``op``'s output (see the module doc)."""
    return op in SAVED_OPS and not is_low_rank_expansion(op, args)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_saved(op, args) else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts() -> Any:
    return create_selective_checkpoint_contexts(_policy)


class CompactBlock:
    """Calls ``block`` so that autograd keeps only :data:`SAVED_OPS`' outputs and the inputs."""

    def __init__(self, block: Callable[..., Any]) -> None:
        self.block = block

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.block(hidden, *args, **kwargs)
        return checkpoint(self.block, hidden, *args, use_reentrant=False, context_fn=_contexts,
                          preserve_rng_state=False, **kwargs)


class _OutputBytes(TorchDispatchMode):
    """Sums the storages of :data:`SAVED_OPS`' outputs, holding them (as the checkpoint's cache
    does) so that no freed address is counted twice or reused."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, int] = {}
        self.held: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if is_saved(func, args):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    st = t.untyped_storage()
                    self.storages[st.data_ptr()] = st.nbytes()
                    self.held.append(t)
        return out


def saved_output_bytes(run: Callable[[], object]) -> int:
    """Bytes a compact kept block saves while ``run`` executes it (the outputs of :data:`SAVED_OPS`,
    distinct storages; its input and parameters aside)."""
    with _OutputBytes() as mode:
        run()
    return sum(mode.storages.values())
