"""What the model layer needs from quantized frozen weights, handed in from above.

:mod:`tinypipe.quant` builds on this layer (it lays quantized weights out in the decomposition's
flat layout), so this layer never imports it. A model holding bitsandbytes weights needs four
things the quantization layer knows: each quantized weight's payload layout (for the flat
layout), and three steps for a device shell (leave the modules' quantization state out of the
copy, check the device and pick the kernels, keep the quantized modules in eval mode). The
runtime passes them in as a :class:`QuantHooks` (:data:`tinypipe.quant.hooks.HOOKS`) to
:class:`~tinypipe.models.decompose.Decomposition`, whose shells use the same hooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn


@dataclass(frozen=True)
class QuantHooks:
    """The quantization layer's helpers, as the model layer calls them."""

    #: parameter name -> payload layout of every quantized parameter of a model; a layout has
    #: ``numel`` (payload elements of the compute dtype), ``scheme``, ``rebuild(payload)`` and
    #: ``attach(module, attr, rebuilt)`` (see :class:`tinypipe.quant.layout.PackedLayout`)
    packed_layouts: Callable[[nn.Module], Mapping[str, Any]]
    #: ``copy.deepcopy`` memo entries that leave the modules' quantization state out of a shell copy
    shell_memo: Callable[[nn.Module], dict[int, Any]]
    #: (shell model, device, schemes): refuse a device the schemes cannot run on, pick the kernels
    prepare_shell: Callable[[nn.Module, torch.device, set[str]], None]
    #: keep a module tree's quantized layers in eval mode whatever mode the rest is in
    freeze_modes: Callable[[nn.Module], None]


def holds_quantized(model: nn.Module) -> bool:
    """Whether ``model`` has bitsandbytes-quantized parameters (by class: bitsandbytes is not imported)."""
    return any(type(p).__module__.startswith("bitsandbytes") for p in model.parameters())
