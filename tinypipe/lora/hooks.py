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
from typing import TYPE_CHECKING, Iterator, Protocol

import torch
from torch import nn

from tinypipe.errors import UnsupportedModelError

if TYPE_CHECKING:
    from tinypipe.memory.host_store import HostStore


class LoraTrainer(Protocol):
    """What :func:`save_merged` reads from a trainer of a PeftModel (:class:`tinypipe.Engine` is
    one): the PeftModel, the host copy of its weights, and the call that makes that copy final. A
    Protocol, so that lora -- a layer below the runtime -- never imports the engine."""

    peft_model: nn.Module | None
    store: HostStore

    def synchronize(self) -> None: ...


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
        raise UnsupportedModelError(f"PeftModel with {len(names)} adapters ({', '.join(names)}); "
                                    "tinypipe trains exactly one")
    cfg = model.peft_config[names[0]]
    if not isinstance(cfg, peft.LoraConfig):
        raise UnsupportedModelError(f"PEFT method {type(cfg).__name__} is not supported; "
                                    "tinypipe trains LoRA adapters")
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


def save_adapter(peft_model: nn.Module, out_dir: str | os.PathLike) -> Path:
    """Write the adapter of ``peft_model`` in PEFT's format (``adapter_config.json`` +
    ``adapter_model.safetensors``): ``PeftModel.from_pretrained(base, out_dir)`` loads it. Under an
    engine its adapter parameters are views of the fp32 master weights, so the trained values are
    written (the engine's ``save_pretrained`` synchronizes first)."""
    if not is_peft_model(peft_model):
        raise UnsupportedModelError(f"{type(peft_model).__name__} is not a peft.PeftModel: "
                                    "no adapter to save")
    pm = peft_model
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the adapter parameters are live views of the master weights: peft clones shared storage
    pm.save_pretrained(str(out), safe_serialization=True)
    return out


def _lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def merged_tensors(peft_model: nn.Module, store: HostStore) -> Iterator[tuple[str, torch.Tensor]]:
    """The merged model's parameters under the base model's own names: ``W + scaling * B @ A``
    (PEFT's ``get_delta_weight``, the math of ``merge_and_unload``) in fp32; adapter tensors
    dropped, everything else as ``store`` (the host copy of ``peft_model``'s inner model) holds it (a
    quantized base weight dequantized)."""
    pm = peft_model
    adapter = pm.active_adapter
    modules = _lora_modules(pm.base_model.model)
    prefixes = sorted(modules, key=len, reverse=True)
    for state in store.iter_layers():  # frozen weights on the SSD: read one layer at a time
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


def save_merged(trainer: LoraTrainer, out_dir: str | os.PathLike,
                dtype: torch.dtype | None = torch.float32) -> Path:
    """Write the base model with the trainer's adapter merged into its weights, as a directory that
    ``AutoModelForCausalLM.from_pretrained`` loads (fp32 unless ``dtype`` says otherwise). Waits
    for the trainer's host copy to be final first (optimizer work may still run after a step)."""
    from tinypipe.models.export import save_hf_directory

    pm = trainer.peft_model
    if pm is None:
        raise UnsupportedModelError("this engine trains no LoRA adapter")
    trainer.synchronize()
    return save_hf_directory(pm.base_model.model, merged_tensors(pm, trainer.store), out_dir, dtype=dtype)
