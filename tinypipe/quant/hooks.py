"""What the model layer needs for bitsandbytes modules, handed to it as :data:`HOOKS`
(:class:`tinypipe.models.quant_hooks.QuantHooks`: the model layer never imports this one).

The decomposition lays a quantized weight out by its payload (:func:`packed_layouts`). A device
shell (:class:`tinypipe.models.shell.Shell`) needs the rest.

A shell is a parameter-less deep copy of the model; its parameters are bound to views of device
slots per task. bitsandbytes modules carry quantization state outside their parameters
(``Linear4bit.quant_state``, ``Linear8bitLt.state``): copied as they are, every shell would hold
another host copy of the scales. The payload in the slot is the only copy that counts, and
binding rebuilds the state from it (:meth:`PackedLayout.bind`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tinypipe.models.quant_hooks import QuantHooks
from tinypipe.quant.model import packed_layouts, quantized_modules
from tinypipe.quant.spec import check_device


def shell_memo(model: nn.Module) -> dict[int, Any]:
    """``copy.deepcopy`` memo entries that leave the modules' quantization state out of a shell
    copy (``Linear4bit.quant_state`` -> None, ``Linear8bitLt.state`` -> an empty state)."""
    memo: dict[int, Any] = {}
    for _, m in quantized_modules(model):
        qs = getattr(m, "quant_state", None)
        if qs is not None:
            memo[id(qs)] = None
        state = getattr(m, "state", None)
        if type(m).__name__ == "Linear8bitLt" and state is not None:
            fresh = type(state)()
            for attr in ("threshold", "has_fp16_weights", "use_pool", "is_training"):
                setattr(fresh, attr, getattr(state, attr))
            memo[id(state)] = fresh
    return memo


def prepare_shell(shell_model: nn.Module, device: torch.device, schemes: set[str]) -> None:
    """Refuse a device bitsandbytes cannot run ``schemes`` on; keep every 4-bit forward on the
    dequantize + matmul path the backward recomputes with (no CPU repacking in eval mode)."""
    for scheme in sorted(schemes):
        check_device(scheme, device)
    for _, m in quantized_modules(shell_model):
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


def freeze_quantized_modes(shell_model: nn.Module) -> None:
    """Keep the quantized base layers in eval mode whatever mode the shell is in: they are frozen,
    and LLM.int8()'s training-mode path differs from the eval-mode kernel the references (PEFT +
    bitsandbytes on a frozen base) use; dropout lives in the LoRA wrappers, which follow the shell."""
    for _, m in quantized_modules(shell_model):
        m.eval()


#: what the runtime passes to :class:`~tinypipe.models.decompose.Decomposition` (``quant=HOOKS``)
HOOKS = QuantHooks(packed_layouts=packed_layouts, shell_memo=shell_memo, prepare_shell=prepare_shell,
                   freeze_modes=freeze_quantized_modes)
