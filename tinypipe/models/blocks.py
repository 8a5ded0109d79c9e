"""Find a causal LM's decoder-block list: the one piece of the decomposition that quantization
(:mod:`tinypipe.quant`, which the decomposition itself uses) needs too -- kept apart so neither
imports the other's module."""

from __future__ import annotations

from torch import nn

from tinypipe.errors import UnsupportedModelError


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(path, module list)`` of the decoder blocks: the largest ``nn.ModuleList`` with
    ``config.num_hidden_layers`` entries."""
    n_layers = getattr(model.config, "num_hidden_layers", None)
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            if n_layers is not None and len(module) != n_layers:
                continue
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[0]:
                best = (size, name, module)
    if best is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no decoder block list (nn.ModuleList of "
            f"num_hidden_layers={n_layers} layers) found"
        )
    return best[1], best[2]
