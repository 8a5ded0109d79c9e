"""Quantize a causal LM's decoder-block linears with bitsandbytes, and read back what a model holds.

What gets quantized is what transformers' ``BitsAndBytesConfig`` quantizes in these models: every
``nn.Linear`` inside the decoder blocks (attention and MLP projections); embeddings, norms and
the LM head stay dense. The modules become bitsandbytes' own ``Linear4bit`` / ``Linear8bitLt``
holding the quantized weight, and the model is marked ``is_loaded_in_4bit`` / ``_8bit`` as
transformers marks it, so PEFT wraps them with its bitsandbytes LoRA layers: the semantics are
PEFT's QLoRA, and an adapter trained here loads over a base that transformers quantized itself.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch
from torch import nn

from tinypipe.errors import UnsupportedModelError
from tinypipe.models.blocks import find_blocks
from tinypipe.quant.layout import PackedLayout, is_quantized_param, layout_of
from tinypipe.quant.spec import QuantizeError, QuantSpec, require_bitsandbytes


def quantizable_linears(model: nn.Module) -> list[str]:
    """Full names of the dense linear layers :func:`quantize_model` turns into bitsandbytes modules
    (every ``nn.Linear`` in the decoder blocks, LoRA's own adapter matrices excluded); also valid on
    meta-device skeletons, so the planner sizes exactly what gets quantized."""
    path, blocks = find_blocks(model)
    out = []
    for i, block in enumerate(blocks):
        for name, m in block.named_modules():
            if name and type(m) is nn.Linear and ".lora_" not in f".{name}":
                out.append(f"{path}.{i}.{name}")
    return out


def _conv1d_names(model: nn.Module) -> list[str]:
    path, blocks = find_blocks(model)
    return [f"{path}.{i}.{n}" for i, b in enumerate(blocks) for n, m in b.named_modules()
            if type(m).__name__ == "Conv1D"]


#: Elements per quantization kernel call on the CPU. bitsandbytes' CPU 4-bit quantizer is torch
#: code with ~24 bytes/element of temporaries (a 235 M-element 70B MLP weight: 5.6 GB); in chunks
#: they stay ~12 MB (1 M-element chunks measured +25 MB of load peak on an 80 M-parameter Llama).
#: Blocks are independent, so chunks aligned to the block size (and to whole rows for int8) give
#: the same bytes as one call (tests/test_qlora.py checks it).
CPU_CHUNK = 1 << 19


def quantize_weight(weight: torch.Tensor, spec: QuantSpec,
                    device: torch.device | str | None = None) -> nn.Parameter:
    """bitsandbytes' frozen parameter for the dense (out, in) ``weight``: cast to the compute dtype
    (as transformers loads a checkpoint in its ``dtype`` before quantizing), quantized on ``device``
    (default: where ``weight`` is; a GPU quantizes a 70B model in minutes, bitsandbytes' CPU
    kernel at ~13 M params/s), returned on the CPU."""
    bnb = require_bitsandbytes()
    w = weight.detach().to(device or weight.device).to(spec.compute_dtype).contiguous()
    if spec.four_bit:
        packed, qs = _quantize_4bit(w, spec)
        del w
        packed = packed.cpu()
        qs.to("cpu")
        return bnb.nn.Params4bit(packed, requires_grad=False, quant_state=qs, blocksize=spec.blocksize,
                                 compress_statistics=spec.double_quant, quant_type=spec.scheme,
                                 quant_storage=torch.uint8, bnb_quantized=True)
    from bitsandbytes.functional import int8_vectorwise_quant

    rows = w.shape[0] if w.device.type != "cpu" else max(1, CPU_CHUNK // max(1, w.shape[1]))
    parts = [int8_vectorwise_quant(w[i : i + rows].to(torch.float16))[:2]  # as Int8Params._quantize does
             for i in range(0, w.shape[0], rows)]
    del w
    cb = torch.cat([p[0].cpu() for p in parts]) if len(parts) > 1 else parts[0][0].cpu()
    scb = torch.cat([p[1].cpu() for p in parts]) if len(parts) > 1 else parts[0][1].cpu()
    return bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)


def _quantize_4bit(w: torch.Tensor, spec: QuantSpec):  # -> (packed, QuantState)
    """``bitsandbytes.functional.quantize_4bit(w, ...)``; on the CPU its kernel op runs on
    :data:`CPU_CHUNK`-element slices and the (double-quantized) state is assembled as
    ``quantize_4bit`` assembles it."""
    from bitsandbytes.functional import QuantState, get_4bit_type, quantize_4bit, quantize_blockwise

    n = w.numel()
    if w.device.type != "cpu" or n <= CPU_CHUNK:
        return quantize_4bit(w, blocksize=spec.blocksize, compress_statistics=spec.double_quant,
                             quant_type=spec.scheme, quant_storage=torch.uint8)
    flat = w.reshape(-1)
    packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8)
    absmax = torch.empty(-(-n // spec.blocksize), dtype=torch.float32)
    op = torch.ops.bitsandbytes.quantize_4bit.default
    for lo in range(0, n, CPU_CHUNK):  # CPU_CHUNK: a multiple of every block size, and even
        p, a = op(flat[lo : lo + CPU_CHUNK], spec.blocksize, spec.scheme, torch.uint8)
        packed[lo // 2 : lo // 2 + p.shape[0]] = p
        absmax[lo // spec.blocksize : lo // spec.blocksize + a.numel()] = a
    code = get_4bit_type(spec.scheme, device=w.device)
    common = dict(shape=w.shape, dtype=w.dtype, blocksize=spec.blocksize, code=code, quant_type=spec.scheme)
    if not spec.double_quant:
        return packed, QuantState(absmax=absmax, **common)
    offset = absmax.mean()
    qabsmax, state2 = quantize_blockwise(absmax - offset, blocksize=256)
    return packed, QuantState(absmax=qabsmax, offset=offset, state2=state2, **common)


def empty_module(linear: nn.Module, spec: QuantSpec) -> nn.Module:
    """The bitsandbytes module replacing ``linear`` (same features and bias), its weight still a
    meta placeholder: :func:`install` puts the quantized weight in."""
    bnb = require_bitsandbytes()
    bias = getattr(linear, "bias", None) is not None
    if spec.four_bit:
        new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias,
                                compute_dtype=spec.compute_dtype, compress_statistics=spec.double_quant,
                                quant_type=spec.scheme, quant_storage=torch.uint8, device="meta")
        # on AVX512-BF16 CPUs bitsandbytes repacks the weight for a fused bf16 kernel in eval-mode
        # no-grad forwards: other numerics than the training path, and weight.data replaced
        new.support_avx512bf16_for_cpu = False
    else:
        new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias, has_fp16_weights=False,
                                  threshold=spec.int8_threshold, device="meta")
        new.compute_dtype = spec.compute_dtype  # Linear8bitLt has none: the flat buffers' unit
        _quiet_int8_cast_warning()
    if bias:
        new.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    new.train(linear.training)
    return new


def install(module: nn.Module, weight: nn.Parameter) -> None:
    """Give a bitsandbytes module (from :func:`empty_module`) its quantized weight."""
    module.weight = weight
    if type(weight).__name__ == "Params4bit":
        weight.module = module


def quantize_model(model: nn.Module, spec: QuantSpec, device: torch.device | str | None = None) -> nn.Module:
    """Quantize ``model``'s decoder-block linears in place (see the module doc); returns it.

    ``device``: where the quantization kernels run (default: where each weight is). A model that
    is quantized already is returned as it is if it matches ``spec``, refused otherwise.
    """
    have = spec_of(model)
    if have is not None:
        same = (have.scheme, have.double_quant, have.compute_dtype) == (spec.scheme, spec.double_quant,
                                                                         spec.compute_dtype)
        if not same:
            raise QuantizeError(f"the model is quantized as {have.label} ({have.compute_dtype}) already, "
                                f"not {spec.label} ({spec.compute_dtype})")
        return model
    if type(model).__name__ == "PeftModel" or any(".lora_" in n for n, _ in model.named_parameters()):
        raise QuantizeError("quantize the base model before adding LoRA adapters")
    conv = _conv1d_names(model)
    if conv:
        raise UnsupportedModelError(f"{type(model).__name__}: {conv[0]} is a GPT-2 style Conv1D; quantized "
                                    "bases need nn.Linear projections (Llama, Mistral, Qwen, OPT)")
    names = quantizable_linears(model)
    if not names:
        raise UnsupportedModelError(f"{type(model).__name__}: no linear layers in the decoder blocks to "
                                    "quantize")
    for full in names:
        parent_name, _, attr = full.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        new = empty_module(old, spec)
        install(new, quantize_weight(old.weight, spec, device))
        setattr(parent, attr, new)
        del old
    mark(model, spec)
    return model


def mark(model: nn.Module, spec: QuantSpec) -> None:
    """Mark ``model`` as transformers marks a bitsandbytes-loaded model (PEFT reads it)."""
    model.is_loaded_in_4bit = spec.four_bit
    model.is_loaded_in_8bit = not spec.four_bit


def quantized_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` in ``model``."""
    for name, m in model.named_modules():
        if type(m).__module__.startswith("bitsandbytes") and type(m).__name__ in (
                "Linear4bit", "LinearNF4", "LinearFP4", "Linear8bitLt"):
            yield name, m


def spec_of(model: nn.Module) -> QuantSpec | None:
    """The :class:`QuantSpec` ``model``'s bitsandbytes modules were quantized with (None: none;
    a model mixing schemes or compute dtypes is refused)."""
    found: set[QuantSpec] = set()
    for _, m in quantized_modules(model):
        w = m.weight
        if type(m).__name__ == "Linear8bitLt":
            dtype = getattr(m, "compute_dtype", None) or torch.bfloat16
            found.add(QuantSpec("int8", compute_dtype=dtype, int8_threshold=float(m.state.threshold)))
            continue
        qs = getattr(w, "quant_state", None) or getattr(m, "quant_state", None)
        dtype = m.compute_dtype or (qs.dtype if qs is not None else torch.bfloat16)
        blocksize = int(qs.blocksize) if qs is not None else int(getattr(w, "blocksize", 64))
        nested = bool(qs.nested) if qs is not None else bool(getattr(w, "compress_statistics", True))
        found.add(QuantSpec(getattr(w, "quant_type", "fp4"), double_quant=nested, blocksize=blocksize,
                            compute_dtype=dtype))
    if len(found) > 1:
        labels = ", ".join(sorted(s.label for s in found))
        raise QuantizeError(f"the model mixes quantization settings ({labels}); tinypipe trains one")
    return next(iter(found), None)


def packed_layouts(model: nn.Module) -> dict[str, PackedLayout]:
    """Parameter name -> payload layout of every quantized parameter (the decomposition's hook).

    An ``Linear8bitLt`` that already ran a forward keeps its int8 rows and scales in its matmul
    state: they are put back on the weight, where a forward finds them again."""
    modules = dict(model.named_modules())
    out = {}
    for name, p in model.named_parameters():
        if not is_quantized_param(p):
            continue
        owner = modules.get(name.rpartition(".")[0])
        if p.requires_grad:
            raise UnsupportedModelError(f"{name}: a quantized weight cannot be trained (requires_grad=True); "
                                        "train LoRA adapters over it")
        if type(p).__name__ == "Int8Params" and getattr(p, "SCB", None) is None:
            state = getattr(owner, "state", None)
            if getattr(state, "SCB", None) is not None:
                p.CB, p.SCB = p.data, state.SCB
                state.CB = state.SCB = None
        out[name] = layout_of(p, owner)
    return out


class _DropCastWarning(logging.Filter):
    """bitsandbytes logs 'inputs will be cast ... to float16' on *every* int8 forward (LLM.int8()
    quantizes activations from fp16 by design): thousands of identical lines per step."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "inputs will be cast" not in record.getMessage()


def _quiet_int8_cast_warning() -> None:
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropCastWarning) for f in logger.filters):
        logger.addFilter(_DropCastWarning())


def dense_param_count(model: nn.Module) -> int:
    """Parameters of ``model`` counting a 4-bit weight as its dense (out x in) elements (its
    ``numel`` is the packed bytes)."""
    total = 0
    for p in model.parameters():
        qs = getattr(p, "quant_state", None) if type(p).__name__ == "Params4bit" else None
        total += qs.shape.numel() if qs is not None else p.numel()
    return total
