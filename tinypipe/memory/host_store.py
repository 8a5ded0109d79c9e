"""The single host copy of training state: fp32 master weights and AdamW moments, per layer.

Each layer owns one contiguous fp32 buffer holding all of its parameters (aligned offsets from
the decomposition's layout), so a layer uploads with one copy and steps with one fused AdamW
call. The Hugging Face model's parameters are re-pointed at views of these buffers: the model
object and the engine share one copy, and ``model.state_dict()`` always shows the master weights.

Frozen parameters (``requires_grad=False``, e.g. the base weights under LoRA adapters) have no
master copy and no moments: they live in one flat buffer per layer at the compute precision
(2 bytes/parameter in bf16), uploaded as they are after the trainable prefix. A
bitsandbytes-quantized weight (QLoRA) sits in the same buffer as its payload bytes (packed codes
and scales, :mod:`tinypipe.quant.layout`), and the model's parameter becomes views of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tinypipe.devices.backend import HostPinner
from tinypipe.devices.host_buffers import PAGE, aligned_empty, registrable
from tinypipe.errors import ConfigError
from tinypipe.models.decompose import Decomposition, LayerSpec, ParamSlice
from tinypipe.models.placement import IN_PLACE_MARK, zero_gaps


@dataclass
class LayerState:
    """Master weights and optimizer moments of one layer (flat fp32)."""

    spec: LayerSpec
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0
    frozen: torch.Tensor | None = None  # frozen parameters, compute dtype (spec offsets - train_numel)

    def view(self, name: str) -> torch.Tensor:
        for p in self.spec.params:
            if p.name == name:
                return self.param_view(p)
        raise KeyError(name)

    def param_view(self, p: ParamSlice) -> torch.Tensor:
        """The live host tensor of parameter slice ``p`` (fp32 master, or the frozen buffer)."""
        if p.trainable:
            return self.master[p.offset : p.offset + p.numel].view(p.shape)
        lo = p.offset - self.spec.train_numel
        return self.frozen[lo : lo + p.numel].view(p.shape)  # type: ignore[index]


def _in_place_master(spec: LayerSpec, named: dict[str, nn.Parameter]) -> torch.Tensor | None:
    """The layer's master buffer if its parameters already are views of one laid out as ``spec``
    (page-aligned start, owning whole pages, as :func:`aligned_empty` makes); else None."""
    if not spec.params:
        return None
    first = named[spec.params[0].name]
    if first.device.type != "cpu" or first.dtype != torch.float32:
        return None
    storage = first.untyped_storage()
    base = storage.data_ptr()
    start = first.data_ptr() - spec.params[0].offset * 4
    nbytes = -(-spec.numel * 4 // PAGE) * PAGE
    if start % PAGE or start < base or start - base + nbytes > storage.nbytes():
        return None
    for p in spec.params:
        t = named[p.name]
        if (
            t.dtype != torch.float32
            or t.device.type != "cpu"
            or tuple(t.shape) != p.shape
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != base
            or t.data_ptr() != start + p.offset * 4
        ):
            return None
    master = torch.empty(0, dtype=torch.float32).set_(storage, (start - base) // 4, (spec.numel,))
    zero_gaps(spec, master)
    return master


class HostStore:
    """One fp32 master + AdamW state per layer; the model's parameters become views into it.

    A model from :func:`tinypipe.load_model` already has its parameters in place (views of
    per-layer buffers in this layout, marked with :data:`IN_PLACE_MARK`): those buffers are
    adopted as they are, so loading plus engine construction never holds the weights twice.
    """

    def __init__(self, model: nn.Module, decomposition: Decomposition, pinner: HostPinner,
                 frozen_dtype: torch.dtype = torch.float32) -> None:
        self.decomposition = decomposition
        self.pinner = pinner
        named = dict(model.named_parameters())
        # set by tinypipe's streaming loader (tinypipe.load_model): the parameters already are views
        # of per-layer master buffers in this store's layout; adopt them instead of copying (once)
        in_place = bool(model.__dict__.pop(IN_PLACE_MARK, False))
        self.layers: list[LayerState] = []
        for spec in decomposition.layers:
            # adopt a loader's buffers only for fully trainable layers (LoRA splits frozen weights out)
            master = _in_place_master(spec, named) if in_place and not spec.frozen_numel else None
            frozen = None
            if master is None:
                master = aligned_empty(spec.train_numel, torch.float32)
                frozen = aligned_empty(spec.frozen_numel, frozen_dtype) if spec.frozen_numel else None
                with torch.no_grad():
                    _fill(master, frozen, spec, named)
            if spec.train_numel:
                pinner.pin(registrable(master))
            if frozen is not None:
                pinner.pin(registrable(frozen))
            state = LayerState(
                spec=spec,
                master=master,
                # uninitialised until the first step zeroes them chunk by chunk, overlapped with
                # backward (first-touching tens of GB here would stall start-up)
                exp_avg=torch.empty(spec.train_numel, dtype=torch.float32),
                exp_avg_sq=torch.empty(spec.train_numel, dtype=torch.float32),
                frozen=frozen,
            )
            self.layers.append(state)

    @property
    def frozen_label(self) -> str:
        """The memory report's name for the frozen weights: ``frozen_weights (nf4+dq)`` when the
        base is quantized."""
        schemes = sorted({p.packed.label for s in self.layers for p in s.spec.params if p.packed is not None})
        return f"frozen_weights ({', '.join(schemes)})" if schemes else "frozen_weights"

    @property
    def master_bytes(self) -> int:
        return sum(s.master.numel() * 4 for s in self.layers)

    @property
    def frozen_bytes(self) -> int:
        return sum(s.frozen.numel() * s.frozen.element_size() for s in self.layers if s.frozen is not None)

    @property
    def optimizer_bytes(self) -> int:
        return sum((s.exp_avg.numel() + s.exp_avg_sq.numel()) * 4 for s in self.layers)

    @property
    def param_count(self) -> int:
        return sum(s.spec.param_count for s in self.layers)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights under the model's own keys (tied aliases included; live views)."""
        out: dict[str, torch.Tensor] = {}
        for s in self.layers:
            for p in s.spec.params:
                view = s.param_view(p)
                for alias in self.decomposition.aliases[p.name]:
                    out[alias] = view
        return out


def _fill(master: torch.Tensor, frozen: torch.Tensor | None, spec: LayerSpec,
          named: dict[str, nn.Parameter]) -> None:
    """Copy the model's parameters into the layer's buffers and re-point them at their views."""
    base = {True: (master, 0), False: (frozen, spec.train_numel)}
    end = {True: 0, False: spec.train_numel}
    for p in spec.params:  # zero only the alignment gaps: the copies fill the rest
        buf, shift = base[p.trainable]
        buf[end[p.trainable] - shift : p.offset - shift].zero_()  # type: ignore[index]
        end[p.trainable] = p.offset + p.numel
    master[end[True]:].zero_()
    if frozen is not None:
        frozen[end[False] - spec.train_numel :].zero_()
    for p in spec.params:
        param = named[p.name]
        buf, shift = base[p.trainable]
        view = buf[p.offset - shift : p.offset - shift + p.numel].view(p.shape)  # type: ignore[index]
        if p.packed is not None:  # a quantized weight: its payload bytes, the parameter re-pointed
            if p.packed.unit != view.element_size():
                raise ConfigError(f"{p.name}: quantized for a {8 * p.packed.unit}-bit compute dtype, the "
                                  f"engine computes in {view.dtype}; quantize for the engine's precision")
            p.packed.adopt(view, param)
            continue
        view.copy_(param.detach())
        param.data = view  # the model now reads the host copy; its old storage is freed
