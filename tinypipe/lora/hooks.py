"""The engine's LoRA hooks: recognise a ``peft.PeftModel``, write its adapter, merge it.

Kept apart from the engine: peft is imported only when a PeftModel is actually given (a model of
that type means peft is already imported), and the engine needs nothing else from it. What the
engine trains is the PeftModel's inner Hugging Face model, whose LoRA layers (PEFT's own modules)
compute the forward; its frozen base parameters (``requires_grad=False``) are held at the
compute precision without gradients or optimizer state (see :mod:`tinypipe.memory.host_store`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from tinypipe.errors import UnsupportedModelError

if TYPE_CHECKING:
    from tinypipe.runtime.engine import Engine


def is_peft_model(model: object) -> bool:
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def split_peft(model: nn.Module) -> tuple[nn.Module | None, nn.Module]:
    """``(peft_model, inner_hf_model)`` for a PeftModel with one LoRA adapter; ``(None, model)``
    for anything else."""
    if not is_peft_model(model):
        return None, model
    import peft

    names = list(model.peft_config)
    if len(names) != 1:
        raise UnsupportedModelError(f"PeftModel with {len(names)} adapters ({', '.join(names)}); tinypipe trains exactly one")
    cfg = model.peft_config[names[0]]
    if not isinstance(cfg, peft.LoraConfig):
        raise UnsupportedModelError(f"PEFT method {type(cfg).__name__} is not supported; tinypipe trains LoRA adapters")
    if getattr(cfg, "modules_to_save", None):
        raise UnsupportedModelError("LoRA modules_to_save (fully trained extra modules) is not supported")
    if getattr(cfg, "use_dora", False):
        raise UnsupportedModelError("DoRA adapters are not supported")
    if getattr(cfg, "bias", "none") != "none":
        raise UnsupportedModelError(f"LoRA bias={cfg.bias!r} is not supported (use 'none')")
    inner = model.base_model.model
    if not any(p.requires_grad for p in inner.parameters()):
        raise UnsupportedModelError("the PeftModel has no trainable parameters (is it in inference mode?)")
    return model, inner


def save_adapter(engine: "Engine", out_dir: str | os.PathLike) -> Path:
    """Write the trained adapter in PEFT's format (``adapter_config.json`` +
    ``adapter_model.safetensors``; fp32 master values): ``PeftModel.from_pretrained(base, out_dir)``
    loads it."""
    pm = engine.peft_model
    if pm is None:
        raise UnsupportedModelError("this engine trains no LoRA adapter")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the adapter parameters are live views of the master weights: peft clones shared storage
    pm.save_pretrained(str(out), safe_serialization=True)
    return out


def _lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def merged_tensors(engine: "Engine") -> Iterator[tuple[str, torch.Tensor]]:
    """The merged model's parameters under the base model's own names: ``W + scaling * B @ A``
    (PEFT's ``get_delta_weight``, the math of ``merge_and_unload``) in fp32; adapter tensors
    dropped, everything else as the engine holds it (a quantized base weight dequantized)."""
    pm = engine.peft_model
    if pm is None:
        raise UnsupportedModelError("this engine trains no LoRA adapter")
    adapter = pm.active_adapter
    modules = _lora_modules(engine.model)
    prefixes = sorted(modules, key=len, reverse=True)
    for state in engine.store.layers:
        for p in state.spec.params:
            t = state.param_view(p)
            if p.packed is not None:  # QLoRA: the quantized base weight, dequantized (tinypipe.quant)
                t = p.packed.dequantize(t)
            owner = next((m for m in prefixes if p.name.startswith(m + ".")), None)
            if owner is None:
                yield p.name, t
                continue
            rest = p.name[len(owner) + 1 :]
            if not rest.startswith("base_layer."):
                continue  # lora_A / lora_B / scaling tensors: folded into the weight
            name = f"{owner}.{rest[len('base_layer.'):]}"
            if rest == "base_layer.weight":
                with torch.no_grad():
                    delta = modules[owner].get_delta_weight(adapter)
                    t = t.float() + delta.float()
            yield name, t


def save_merged(engine: "Engine", out_dir: str | os.PathLike, dtype: torch.dtype | None = torch.float32) -> Path:
    """Write the base model with the adapter merged into its weights, as a directory that
    ``AutoModelForCausalLM.from_pretrained`` loads (fp32 unless ``dtype`` says otherwise)."""
    from tinypipe.models.export import save_hf_directory

    return save_hf_directory(engine.model, merged_tensors(engine), out_dir, dtype=dtype)
