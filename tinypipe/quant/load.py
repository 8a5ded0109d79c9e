"""Load a Hugging Face safetensors checkpoint with its decoder-block linears quantized on the way in.

The model is built from its config with meta parameters (:func:`build_skeleton`), its block
linears become empty bitsandbytes modules, every other parameter is allocated at the compute
dtype, and the checkpoint's tensors are read one at a time: a block linear's dense weight is
quantized as soon as it is read and dropped, everything else is read into place. The dense model
never exists: host memory grows by the quantized model plus one tensor in flight (and the
quantization kernel's temporaries).

A checkpoint that transformers saved quantized with bitsandbytes (``config.json`` carrying a
``quantization_config`` with ``quant_method: bitsandbytes``; ``*.weight`` plus its
``weight.absmax`` / ``weight.quant_map`` / ``weight.nested_*`` / ``weight.quant_state.*`` or
``SCB`` tensors) is taken as it is: the stored codes and scales become the parameters.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tinypipe.models.safetensors_stream import read_header, read_tensor
from tinypipe.models.skeleton import build_skeleton, fill, plan_checkpoint_keys
from tinypipe.quant.model import empty_module, install, mark, quantizable_linears, quantize_weight
from tinypipe.quant.spec import COMPUTE_DTYPES, QuantizeError, QuantSpec, require_bitsandbytes

#: Suffixes transformers writes next to a bitsandbytes weight (``<module>.weight.<suffix>``, or
#: ``<module>.<suffix>`` for int8's row scales).
_QS_WEIGHT = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state.bitsandbytes__nf4",
              "quant_state.bitsandbytes__fp4")
_QS_MODULE = ("SCB", "weight_format")


def prequantized_spec(config: Any, compute: str) -> QuantSpec | None:
    """The spec of a checkpoint transformers saved quantized with bitsandbytes (None: not one)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    d = qc if isinstance(qc, dict) else (qc.to_dict() if hasattr(qc, "to_dict") else vars(qc))
    method = str(getattr(d.get("quant_method"), "value", d.get("quant_method")))
    if method != "bitsandbytes":
        raise QuantizeError(f"checkpoint quantized with {method!r}; tinypipe trains over bitsandbytes "
                            "(nf4/fp4/int8) or dense checkpoints")
    if d.get("load_in_8bit"):
        return QuantSpec("int8", compute_dtype=COMPUTE_DTYPES[compute],
                         int8_threshold=float(d.get("llm_int8_threshold", 6.0)))
    return QuantSpec(str(d.get("bnb_4bit_quant_type", "fp4")),
                     double_quant=bool(d.get("bnb_4bit_use_double_quant")),
                     compute_dtype=COMPUTE_DTYPES[compute])


class _Targets:
    """Checkpoint key -> what it fills, for :func:`plan_checkpoint_keys` (the materialiser's
    interface): parameters by canonical name or alias, persistent buffers, keys with or without
    the base-model prefix, and (pre-quantized checkpoints) the bitsandbytes state tensors."""

    def __init__(self, model: nn.Module, quantized: set[str], extra: set[str]) -> None:
        self.model = model
        self.quantized = quantized  # canonical names of the weights that become bitsandbytes ones
        self.extra = extra  # model keys of stored quantization state
        groups: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(n)
        self._param_keys = {n: names[0] for names in groups.values() for n in names}
        self.parameter_names = [names[0] for names in groups.values()]
        self._buffers: dict[str, torch.Tensor] = {}
        for mod_name, module in model.named_modules():
            for key, buf in module._buffers.items():
                if buf is not None and key not in module._non_persistent_buffers_set:
                    self._buffers[f"{mod_name}.{key}" if mod_name else key] = buf
        prefix = getattr(model, "base_model_prefix", "") or ""
        self._alternatives: dict[str, str] = {}
        for key in [*self._param_keys, *self._buffers, *extra]:
            if not prefix:
                break
            if key.startswith(prefix + "."):
                self._alternatives.setdefault(key[len(prefix) + 1 :], key)
            else:
                self._alternatives.setdefault(f"{prefix}.{key}", key)
        patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
        self._ignored = [re.compile(p) for p in patterns]

    def resolve(self, key: str) -> str | None:
        if key in self._param_keys or key in self._buffers or key in self.extra:
            return key
        return self._alternatives.get(key)

    def canonical(self, model_key: str) -> str | None:
        return self._param_keys.get(model_key)

    def ignored(self, key: str) -> bool:
        return any(p.search(key) for p in self._ignored)

    def target(self, model_key: str) -> torch.Tensor:
        canon = self._param_keys.get(model_key)
        if canon is not None:
            return self.model.get_parameter(canon)
        return self._buffers[model_key]


def _release_freed() -> None:
    """Hand the quantizer's freed scratch back to the OS (glibc ``malloc_trim``; elsewhere a no-op).

    bitsandbytes' CPU quantizer allocates megabytes of short-lived temporaries per call, between
    the small long-lived outputs: glibc keeps the freed heap pages resident, and over a model's
    few hundred weights RSS grew by ~2x the quantized model (measured on a 62 M-parameter Llama:
    +160 MB for 50 MB kept; +37 MB with this after every weight)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _materialise(model: nn.Module, dtype: torch.dtype, skip: set[str]) -> None:
    """Allocate every meta parameter except the ``skip`` ones (shared parameters stay shared)."""
    skip_ids = {id(model.get_parameter(n)) for n in skip}
    new_for: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None or id(p) in skip_ids:
                continue
            if id(p) not in new_for:
                new_for[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype),
                                              requires_grad=p.requires_grad)
            module._parameters[key] = new_for[id(p)]


def _state_keys(module: str) -> list[str]:
    return [f"{module}.weight.{s}" for s in _QS_WEIGHT] + [f"{module}.{s}" for s in _QS_MODULE]


def _extra_keys(linears: list[str], stored: set[str], prefix: str) -> set[str]:
    """Model keys of the quantization state stored for ``linears`` (pre-quantized checkpoints)."""
    out = set()
    for m in linears:
        for cand in _state_keys(m):
            short = cand[len(prefix) + 1 :] if prefix and cand.startswith(prefix + ".") else None
            if cand in stored or (short is not None and short in stored) or f"{prefix}.{cand}" in stored:
                out.add(cand)
    return out


def _prequantized_param(module: str, parts: dict[str, torch.Tensor], spec: QuantSpec) -> nn.Parameter:
    bnb = require_bitsandbytes()
    weight = parts.pop(f"{module}.weight")
    if not spec.four_bit:
        scb = parts.get(f"{module}.SCB")
        if scb is None or weight.dtype != torch.int8:
            raise ValueError(f"{module}: an int8 weight needs int8 rows and its SCB row scales")
        return bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False, CB=weight, SCB=scb)
    from bitsandbytes.functional import QuantState

    qs = QuantState.from_dict({k[len(module) + len(".weight."):]: v for k, v in parts.items()
                               if k.startswith(f"{module}.weight.")}, device=torch.device("cpu"))
    if qs.quant_type != spec.scheme:
        raise QuantizeError(f"{module}: stored as {qs.quant_type}, not {spec.scheme}")
    return bnb.nn.Params4bit(weight.view(torch.uint8), requires_grad=False, quant_state=qs,
                             blocksize=qs.blocksize, compress_statistics=qs.nested, quant_type=qs.quant_type,
                             quant_storage=torch.uint8, bnb_quantized=True)


def load_quantized(config: Any, files: list[Path], where: str, spec: QuantSpec, *,
                   prequantized: bool = False, device: torch.device | str | None = None) -> nn.Module:
    """The causal LM of ``config``, block linears quantized with ``spec`` while ``files`` stream.

    ``prequantized``: the files hold bitsandbytes-quantized weights (see the module doc).
    ``device``: where the quantization kernels run (a CUDA device is minutes for 70B; the CPU
    kernel ~13 M params/s). Raises ``ValueError`` / ``OSError`` with one-line messages.
    """
    require_bitsandbytes()
    model = build_skeleton(config)
    if hasattr(model.config, "quantization_config"):  # the trained model saves dense, not quantized
        delattr(model.config, "quantization_config")
    linears = quantizable_linears(model)
    if not linears:
        raise QuantizeError(f"{type(model).__name__}: no nn.Linear in the decoder blocks to quantize")
    for full in linears:
        parent, _, attr = full.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, attr, empty_module(getattr(owner, attr), spec))
    weights = {f"{m}.weight" for m in linears}
    _materialise(model, spec.compute_dtype, weights)
    per_file = [read_header(f) for f in files]
    stored = {e.name for entries in per_file for e in entries}
    prefix = getattr(model, "base_model_prefix", "") or ""
    extra = _extra_keys(linears, stored, prefix) if prequantized else set()
    targets = _Targets(model, weights, extra)
    wanted = plan_checkpoint_keys(targets, sorted(stored), where)
    owner_of = {f"{m}.weight": m for m in linears}  # quantized weight (or its stored state) -> module
    owner_of.update({k: m for m in linears for k in _state_keys(m) if k in extra})
    pending: dict[str, dict[str, torch.Tensor]] = {}
    need: dict[str, int] = {}
    for key in wanted.values():
        if prequantized and key in owner_of:
            need[owner_of[key]] = need.get(owner_of[key], 0) + 1
    for file, entries in zip(files, per_file):
        with open(file, "rb", buffering=0) as fh:
            for e in entries:
                model_key = wanted.get(e.name)
                if model_key is None:
                    continue
                canon = targets.canonical(model_key) or model_key
                if canon in weights or canon in extra:
                    tensor = read_tensor(fh, e)
                    module = owner_of[canon]
                    if not prequantized:
                        install(model.get_submodule(module), quantize_weight(tensor, spec, device))
                        del tensor
                        _release_freed()
                        continue
                    else:
                        parts = pending.setdefault(module, {})
                        parts[canon] = tensor
                        if len(parts) == need[module]:
                            param = _prequantized_param(module, pending.pop(module), spec)
                            install(model.get_submodule(module), param)
                    del tensor
                    continue
                target = targets.target(model_key)
                tensor = read_tensor(fh, e, target)
                if tensor is not None:
                    fill(target, tensor, e.name, str(file))
                    del tensor
    if pending:
        raise ValueError(f"{where}: incomplete quantized weights: {', '.join(sorted(pending)[:3])}")
    mark(model, spec)
    model.eval()
    return model
