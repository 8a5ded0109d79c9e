"""One quantized weight as a byte payload inside a layer's flat buffer.

tinypipe moves a layer as one flat tensor at the compute precision: host buffer, upload into a
device slot, views bound to the model. A bitsandbytes weight is several tensors -- the packed
4-bit codes (or int8 rows), the block scales (fp32, or 8-bit with their own fp32 scales and code
book under double quantization), the code book -- plus metadata. Here they are laid out back to
back (each part 128-byte aligned) as one payload, and the payload is *reinterpreted* as
``ceil(bytes / itemsize)`` elements of the compute dtype. So the store keeps one copy of the
quantized bytes, the existing upload copies them like any frozen weight, and binding rebuilds
bitsandbytes' own ``Params4bit`` + ``QuantState`` (or ``Int8Params``) as views of the slot's bytes:
no dequantized copy exists outside the kernels.

:func:`layout_for` is pure arithmetic on a weight's shape, so the planner sizes a quantized
model exactly without building it; :func:`layout_of` reads the layout off a live bitsandbytes
parameter (the two agree: tests/test_qlora.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tinypipe.quant.spec import QuantizeError, QuantSpec, require_bitsandbytes

#: Byte alignment of every part inside a payload (fp32 scales need 4; vector loads like 16+).
PART_ALIGN = 128
#: bitsandbytes' double quantization: 8-bit block scales in blocks of 256 (its only supported size).
NESTED_BLOCKSIZE = 256
CODE_4BIT = 16  # entries of the NF4/FP4 code book (fp32)
CODE_8BIT = 256  # entries of the dynamic 8-bit map of the nested scales (fp32)


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Part:
    """One tensor of a payload: its byte offset, dtype and shape."""

    name: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class PackedLayout:
    """Where the parts of one quantized weight lie in its payload, and how to rebuild it.

    ``shape`` is the dense weight's (out_features, in_features); ``dtype`` the dtype bitsandbytes
    dequantizes to outside a matmul (``QuantState.dtype``); ``unit`` the byte size of the flat
    buffer's elements (the compute dtype's), so the payload occupies :attr:`numel` of them.
    """

    scheme: str
    shape: tuple[int, int]
    dtype: torch.dtype
    unit: int
    parts: tuple[Part, ...]
    blocksize: int = 0  # 4-bit: elements per block scale
    nested: bool = False  # 4-bit: double-quantized scales
    threshold: float = 0.0  # int8: LLM.int8() outlier threshold

    @property
    def label(self) -> str:
        """``nf4``, ``nf4+dq``, ``fp4``, ``int8`` (as :attr:`QuantSpec.label`)."""
        return f"{self.scheme}+dq" if self.nested else self.scheme

    @property
    def nbytes(self) -> int:
        last = self.parts[-1]
        return last.offset + last.nbytes

    @property
    def numel(self) -> int:
        """Elements of the compute dtype the payload occupies in a flat buffer."""
        return -(-self.nbytes // self.unit)

    @property
    def dense_numel(self) -> int:
        return self.shape[0] * self.shape[1]

    # -- views ---------------------------------------------------------------------------------

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each part as a view of ``flat`` (the payload's ``numel`` elements, contiguous)."""
        if flat.numel() != self.numel or not flat.is_contiguous() or flat.element_size() != self.unit:
            raise QuantizeError(f"a {self.scheme} payload needs {self.numel} contiguous elements of "
                                f"{self.unit} bytes, got {flat.numel()} x {flat.element_size()}")
        raw = flat.reshape(-1).view(torch.uint8)
        return {p.name: raw[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape) for p in self.parts}

    def write(self, flat: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a weight's parts (as :func:`parts_of` returns them) into its payload."""
        views = self.views(flat)
        for p in self.parts:
            src = tensors[p.name]
            if src.numel() * src.element_size() != p.nbytes:
                raise QuantizeError(f"{self.scheme} part {p.name}: {src.numel()} x {src.element_size()} "
                                    f"bytes, the layout expects {p.nbytes} (quantized with other settings?)")
            views[p.name].copy_(src.reshape(-1).view(p.dtype).view(p.shape))
        raw = flat.reshape(-1).view(torch.uint8)
        end = 0
        for p in self.parts:  # zero the alignment gaps: payloads compare and hash byte for byte
            raw[end : p.offset].zero_()
            end = p.offset + p.nbytes
        raw[end:].zero_()

    # -- bitsandbytes objects ------------------------------------------------------------------

    def param(self, flat: torch.Tensor) -> nn.Parameter:
        """bitsandbytes' frozen parameter (``Params4bit`` with its ``QuantState``, or
        ``Int8Params``) whose tensors are views of ``flat``."""
        bnb = require_bitsandbytes()
        v = self.views(flat)
        if self.scheme == "int8":
            return bnb.nn.Int8Params(v["CB"], requires_grad=False, has_fp16_weights=False, CB=v["CB"],
                                     SCB=v["SCB"])
        from bitsandbytes.functional import QuantState

        state2 = None
        if self.nested:
            state2 = QuantState(absmax=v["nested_absmax"], code=v["nested_code"], blocksize=NESTED_BLOCKSIZE,
                                dtype=torch.float32)
        qs = QuantState(absmax=v["absmax"], shape=torch.Size(self.shape), code=v["code"],
                        blocksize=self.blocksize, quant_type=self.scheme, dtype=self.dtype,
                        offset=v["offset"] if self.nested else None, state2=state2)
        return bnb.nn.Params4bit(v["packed"], requires_grad=False, quant_state=qs, blocksize=self.blocksize,
                                 compress_statistics=self.nested, quant_type=self.scheme,
                                 quant_storage=torch.uint8, bnb_quantized=True)

    def rebuild(self, flat: torch.Tensor) -> tuple[nn.Parameter, dict[str, torch.Tensor]]:
        """(bitsandbytes' parameter, the part views) for the payload in ``flat``: what
        :meth:`attach` binds. Reusable for the same ``flat`` (the views read its current bytes)."""
        return self.param(flat), self.views(flat)

    def attach(self, module: nn.Module, attr: str,
               rebuilt: tuple[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Point ``module.<attr>`` (a bitsandbytes linear's weight) at a :meth:`rebuild` result."""
        param, views = rebuilt
        module._parameters[attr] = param
        if self.scheme == "int8":  # the state a forward's init_8bit_state would leave
            param.CB = param.SCB = None
            module.state.CB, module.state.SCB = views["CB"], views["SCB"]
        elif getattr(module, "quant_state", None) is not None:
            module.quant_state = param.quant_state

    def bind(self, module: nn.Module, attr: str, flat: torch.Tensor) -> None:
        """Point ``module.<attr>`` at the payload in ``flat`` (:meth:`rebuild` + :meth:`attach`)."""
        self.attach(module, attr, self.rebuild(flat))

    def adopt(self, flat: torch.Tensor, param: nn.Parameter, module: nn.Module | None = None) -> None:
        """Write ``param``'s parts into ``flat`` and re-point ``param`` (and its module's state) at
        them: the host model keeps working on the one stored copy; the old tensors are freed."""
        self.write(flat, parts_of(param, module))
        new = self.param(flat)
        param.data = new.data
        if self.scheme == "int8":
            param.CB, param.SCB = new.CB, new.SCB
            if module is not None:
                module.state.CB = module.state.SCB = None
        else:
            param.quant_state = new.quant_state
            owner = module if module is not None else getattr(param, "module", None)
            if owner is not None and getattr(owner, "quant_state", None) is not None:
                owner.quant_state = new.quant_state

    def dequantize(self, flat: torch.Tensor) -> torch.Tensor:
        """The dense (out, in) weight bitsandbytes computes with, in :attr:`dtype` (a new tensor)."""
        param = self.param(flat)
        if self.scheme == "int8":
            return (param.CB.float() * (param.SCB.float().unsqueeze(1) / 127.0)).to(self.dtype)
        from bitsandbytes.functional import dequantize_4bit

        return dequantize_4bit(param.data, param.quant_state).view(self.shape)


def _parts(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[Part, ...]:
    out, offset = [], 0
    for name, dtype, shape in specs:
        part = Part(name, offset, dtype, shape)
        out.append(part)
        offset = _up(offset + part.nbytes, PART_ALIGN)
    return tuple(out)


def layout_4bit(shape: tuple[int, int], quant_type: str, blocksize: int, nested: bool, dtype: torch.dtype,
                unit: int) -> PackedLayout:
    """The payload of a ``Linear4bit`` weight of ``shape`` (out, in): packed codes (2 per byte),
    block scales (fp32; 8-bit under double quantization, plus the offset, the nested fp32 scales
    and the 256-entry map), the 16-entry code book."""
    n = shape[0] * shape[1]
    blocks = -(-n // blocksize)
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
        ("packed", torch.uint8, ((n + 1) // 2, 1)),
        ("absmax", torch.uint8 if nested else torch.float32, (blocks,)),
        ("code", torch.float32, (CODE_4BIT,)),
    ]
    if nested:
        specs += [("offset", torch.float32, ()),
                  ("nested_absmax", torch.float32, (-(-blocks // NESTED_BLOCKSIZE),)),
                  ("nested_code", torch.float32, (CODE_8BIT,))]
    return PackedLayout(quant_type, (int(shape[0]), int(shape[1])), dtype, unit, _parts(specs),
                        blocksize=blocksize, nested=nested)


def layout_int8(shape: tuple[int, int], dtype: torch.dtype, unit: int, threshold: float) -> PackedLayout:
    """The payload of a ``Linear8bitLt`` weight: int8 rows and one fp32 scale per row."""
    specs = [("CB", torch.int8, (int(shape[0]), int(shape[1]))), ("SCB", torch.float32, (int(shape[0]),))]
    dense = (int(shape[0]), int(shape[1]))
    return PackedLayout("int8", dense, dtype, unit, _parts(specs), threshold=threshold)


def layout_for(shape: tuple[int, int], spec: QuantSpec) -> PackedLayout:
    """The payload a weight of dense ``shape`` gets under ``spec`` (no bitsandbytes needed)."""
    if spec.four_bit:
        return layout_4bit(shape, spec.scheme, spec.blocksize, spec.double_quant, spec.compute_dtype,
                           spec.unit)
    return layout_int8(shape, spec.compute_dtype, spec.unit, spec.int8_threshold)


def is_quantized_param(p: Any) -> bool:
    """A bitsandbytes 4-bit or int8 frozen parameter (checked by class name: no import)."""
    return type(p).__name__ in ("Params4bit", "Int8Params") and type(p).__module__.startswith("bitsandbytes")


def _unit_dtype(module: nn.Module | None, fallback: torch.dtype) -> torch.dtype:
    dtype = getattr(module, "compute_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else fallback


def layout_of(param: nn.Parameter, module: nn.Module | None) -> PackedLayout:
    """The layout of a live bitsandbytes parameter (its unit: the module's compute dtype)."""
    if type(param).__name__ == "Int8Params":
        if param.dtype != torch.int8:
            raise QuantizeError("an Int8Params weight that is not quantized yet (move the model to its "
                                "device first, or let tinypipe quantize it)")
        dtype = _unit_dtype(module, torch.bfloat16)
        threshold = float(getattr(getattr(module, "state", None), "threshold", 0.0) or 0.0)
        return layout_int8(tuple(param.shape), dtype, torch.empty((), dtype=dtype).element_size(), threshold)
    qs = getattr(param, "quant_state", None) or getattr(module, "quant_state", None)
    if qs is None or len(qs.shape) != 2:
        raise QuantizeError("a Params4bit weight without its 2-D quantization state (not quantized yet?)")
    if qs.nested and qs.state2.blocksize != NESTED_BLOCKSIZE:
        raise QuantizeError(f"double-quantized scales in blocks of {qs.state2.blocksize}; bitsandbytes' "
                            f"kernels take {NESTED_BLOCKSIZE}")
    dtype = _unit_dtype(module, qs.dtype)
    return layout_4bit(tuple(qs.shape), qs.quant_type, int(qs.blocksize), bool(qs.nested), qs.dtype,
                       torch.empty((), dtype=dtype).element_size())


def parts_of(param: nn.Parameter, module: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """A live bitsandbytes parameter's tensors under the payload's part names."""
    if type(param).__name__ == "Int8Params":
        state = getattr(module, "state", None)
        cb = param.CB if getattr(param, "CB", None) is not None else param.data
        scb = param.SCB if getattr(param, "SCB", None) is not None else getattr(state, "SCB", None)
        if scb is None:
            raise QuantizeError("an Int8Params weight without its row scales (SCB)")
        return {"CB": cb.detach(), "SCB": scb.detach()}
    qs = getattr(param, "quant_state", None) or getattr(module, "quant_state", None)
    out = {"packed": param.data.detach().contiguous().view(torch.uint8), "absmax": qs.absmax, "code": qs.code}
    if qs.nested:
        out.update(offset=qs.offset.reshape(()).float(), nested_absmax=qs.state2.absmax,
                   nested_code=qs.state2.code)
    return out
