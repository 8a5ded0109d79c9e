"""Exact flat sizes of a quantized model from its unquantized skeleton: what the planner needs.

The layout rule is the decomposition's (:func:`tinypipe.models.decompose._layout`): a layer's flat
size is the sum of its parameters' sizes, each rounded up to :data:`ALIGN` elements; a quantized
weight counts its payload (:func:`tinypipe.quant.layout.layout_for`). Pure arithmetic on shapes,
so a 70B model is sized from a meta-device skeleton in seconds, without bitsandbytes.
"""

from __future__ import annotations

from torch import nn

from tinypipe.models.decompose import ALIGN, Decomposition
from tinypipe.quant.layout import layout_for
from tinypipe.quant.model import quantizable_linears
from tinypipe.quant.spec import QuantSpec


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def quantized_sizes(dec: Decomposition, model: nn.Module, spec: QuantSpec) -> tuple[list[int], list[int]]:
    """(flat numel per layer, dense elements quantized per layer) of ``dec``'s layers once
    ``model``'s block linears (:func:`quantizable_linears`) are quantized with ``spec``; ``dec``
    decomposes the unquantized ``model`` (LoRA adapters included)."""
    weights = {f"{m}.weight" for m in quantizable_linears(model)}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    numels, quantized = [], []
    for layer in dec.layers:
        flat = dense = 0
        for p in layer.params:
            if p.name in weights and not p.trainable:
                flat += _aligned(layout_for(shapes[p.name], spec).numel)  # type: ignore[arg-type]
                dense += p.numel
            else:
                flat += _aligned(p.numel)
        numels.append(flat)
        quantized.append(dense)
    return numels, quantized
