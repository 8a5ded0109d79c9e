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

State a plan offloads to the SSD (:class:`~tinypipe.memory.offload.OffloadedState`) is never
allocated here: its :class:`LayerState` field is a placeholder on the ``meta`` device (right
shape and dtype, no memory; any use fails loudly), the master weights and frozen weights are
written to the scratch file at construction (one layer buffer at a time), and the model's
parameters of those layers become meta tensors -- read them with :meth:`HostStore.state_dict`
or :meth:`HostStore.iter_layers`, which read the SSD. Frozen weights of a model streamed from
safetensors are not copied at all: their region is the checkpoint's own byte ranges
(:mod:`tinypipe.storage.frozen_source`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from tinypipe.devices.backend import HostPinner
from tinypipe.devices.host_buffers import PAGE, aligned_empty, registrable
from tinypipe.errors import ConfigError
from tinypipe.memory.offload import REGIONS_OF, OffloadedState
from tinypipe.models.decompose import Decomposition, LayerSpec, ParamSlice
from tinypipe.models.placement import IN_PLACE_MARK, zero_gaps
from tinypipe.storage.frozen_source import ExternalRegion, FileHandles, frozen_region


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


@dataclass
class SliceState(LayerState):
    """A slice of a layer's state (a rank's shard, a chunk stepped on a device): offsets in it are
    relative to ``base``, the slice's start in the layer's flat buffer (what anything keyed by
    layer offsets -- parameter boundaries, decay groups -- adds)."""

    base: int = 0


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
                 frozen_dtype: torch.dtype = torch.float32, *,
                 offload: Mapping[int, frozenset[str]] | None = None,
                 offload_dir: str | None = None, retain_grad: bool = False) -> None:
        self.decomposition = decomposition
        self.pinner = pinner
        named = dict(model.named_parameters())
        # set by tinypipe's streaming loader (tinypipe.load_model): the parameters already are views
        # of per-layer master buffers in this store's layout; adopt them instead of copying (once)
        in_place = bool(model.__dict__.pop(IN_PLACE_MARK, False))
        # the SSD regions first: a bad directory or too little free space fails before any allocation
        self.offload: OffloadedState | None = None
        regions = offload_regions(decomposition, offload, frozen_dtype, retain_grad) if offload else {}
        if regions:  # (kinds a layer does not have -- a gradient not retained -- take no region)
            if offload_dir is None:
                raise ValueError("offloaded state needs an offload directory")
            from_files = _checkpoint_regions(decomposition, named, regions, frozen_dtype)
            self.offload = OffloadedState(offload_dir, regions, from_files)
        external = set(self.offload.external) if self.offload is not None else set()
        spill = _SpillBuffers()
        self.layers: list[LayerState] = []
        for i, spec in enumerate(decomposition.layers):
            off = self.offload
            off_master = off is not None and off.has(i, "master")
            off_frozen = off is not None and off.has(i, "frozen")
            in_checkpoint = (i, "frozen") in external  # read from the model's own files: no copy at all
            # adopt a loader's buffers only for fully trainable layers (LoRA splits frozen weights out)
            master = _in_place_master(spec, named) if in_place and not spec.frozen_numel else None
            frozen = None
            if master is None:
                master = spill.get("master", spec.train_numel, torch.float32) if off_master else (
                    aligned_empty(spec.train_numel, torch.float32))
                if spec.frozen_numel and not in_checkpoint:
                    frozen = spill.get("frozen", spec.frozen_numel, frozen_dtype) if off_frozen else (
                        aligned_empty(spec.frozen_numel, frozen_dtype))
                with torch.no_grad():
                    _fill(master, frozen, spec, named)
            if off is not None and off_master:  # to the SSD, then no DRAM copy at all
                off.write((i, "master"), master)
                _params_to_meta(spec, named, trainable=True)
                master = _placeholder(spec.train_numel, torch.float32)
            if off is not None and off_frozen and (frozen is not None or in_checkpoint):
                if not in_checkpoint:
                    off.write((i, "frozen"), frozen)
                _params_to_meta(spec, named, trainable=False)
                frozen = _placeholder(spec.frozen_numel, frozen_dtype)
            if spec.train_numel and master.device.type == "cpu":
                pinner.pin(registrable(master))
            if frozen is not None and frozen.device.type == "cpu":
                pinner.pin(registrable(frozen))
            moments_off = off is not None and off.has(i, "exp_avg")
            state = LayerState(
                spec=spec,
                master=master,
                # uninitialised until the first step zeroes them chunk by chunk, overlapped with
                # backward (first-touching tens of GB here would stall start-up)
                # page-aligned: an assisted update (runtime/optim/assist.py) registers them in place
                exp_avg=_placeholder(spec.train_numel, torch.float32) if moments_off else (
                    aligned_empty(spec.train_numel, torch.float32)),
                exp_avg_sq=_placeholder(spec.train_numel, torch.float32) if moments_off else (
                    aligned_empty(spec.train_numel, torch.float32)),
                frozen=frozen,
            )
            self.layers.append(state)
        if self.offload is not None:
            release_freed_memory()  # the model's own copies of what now lives on the SSD

    @property
    def frozen_label(self) -> str:
        """The memory report's name for the frozen weights: ``frozen_weights (nf4+dq)`` when the
        base is quantized."""
        schemes = sorted({p.packed.label for s in self.layers for p in s.spec.params if p.packed is not None})
        return f"frozen_weights ({', '.join(schemes)})" if schemes else "frozen_weights"

    @property
    def master_bytes(self) -> int:
        """DRAM bytes of the master weights (offloaded ones not counted: :meth:`ssd_bytes`)."""
        return sum(_dram_bytes(s.master) for s in self.layers)

    @property
    def frozen_bytes(self) -> int:
        return sum(_dram_bytes(s.frozen) for s in self.layers if s.frozen is not None)

    @property
    def optimizer_bytes(self) -> int:
        return sum(_dram_bytes(s.exp_avg) + _dram_bytes(s.exp_avg_sq) for s in self.layers)

    def ssd_bytes(self) -> dict[str, int]:
        """Bytes on the SSD per plan kind (empty without offload)."""
        return {} if self.offload is None else self.offload.bytes_by_kind()

    def offloaded(self, layer: int, name: str) -> bool:
        """Whether ``layer``'s ``name`` (a LayerState field or "grad") lives on the SSD."""
        return self.offload is not None and self.offload.has(layer, name)

    def dram_layer(self, layer: int) -> LayerState:
        """``layer``'s state with every tensor in DRAM: the live LayerState when none of it is
        offloaded, else a copy whose offloaded tensors were read from the SSD (moments never
        written are uninitialised, as they are in DRAM before a layer's first step)."""
        s = self.layers[layer]
        off = self.offload
        names = [] if off is None else [n for n in off.names(layer) if n != "grad"]
        if not names:
            return s
        fields = {n: off.read_new((layer, n)) for n in names}  # type: ignore[union-attr]
        return replace(s, **fields)

    def iter_layers(self) -> Iterator[LayerState]:
        """Every layer's :meth:`dram_layer`, one at a time (an offloaded layer's copies are dropped
        when the next is read, so a streaming reader holds one layer in DRAM)."""
        for i in range(len(self.layers)):
            yield self.dram_layer(i)

    def restore_layer(self, layer: int, master: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor) -> None:
        """Set ``layer``'s master weights and moments (a checkpoint being loaded): copied into DRAM,
        or written to the SSD where they live there."""
        s = self.layers[layer]
        with torch.no_grad():
            for name, src in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                if self.offloaded(layer, name):
                    self.offload.write_copy((layer, name), src)  # type: ignore[union-attr]
                else:
                    getattr(s, name).copy_(src)

    def close(self) -> None:
        """Remove the SSD tier's scratch files (idempotent; nothing without offload)."""
        if self.offload is not None:
            self.offload.close()

    @property
    def param_count(self) -> int:
        return sum(s.spec.param_count for s in self.layers)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights under the model's own keys (tied aliases included; live views, or
        copies for layers whose state lives on the SSD)."""
        out: dict[str, torch.Tensor] = {}
        for s in self.iter_layers():  # offloaded layers: copies read from the SSD
            for p in s.spec.params:
                view = s.param_view(p)
                for alias in self.decomposition.aliases[p.name]:
                    out[alias] = view
        return out


def _fill(master: torch.Tensor, frozen: torch.Tensor | None, spec: LayerSpec,
          named: dict[str, nn.Parameter]) -> None:
    """Copy the model's parameters into the layer's buffers and re-point them at their views
    (``frozen`` None: the frozen ones are left alone -- read from the checkpoint)."""
    base = {True: (master, 0), False: (frozen, spec.train_numel)}
    end = {True: 0, False: spec.train_numel}
    params = [p for p in spec.params if p.trainable or frozen is not None]
    for p in params:  # zero only the alignment gaps: the copies fill the rest
        buf, shift = base[p.trainable]
        buf[end[p.trainable] - shift : p.offset - shift].zero_()  # type: ignore[index]
        end[p.trainable] = p.offset + p.numel
    master[end[True]:].zero_()
    if frozen is not None:
        frozen[end[False] - spec.train_numel :].zero_()
    for p in params:
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


def _checkpoint_regions(dec: Decomposition, named: Mapping[str, torch.Tensor],
                        regions: Mapping[tuple[int, str], tuple[int, torch.dtype]],
                        frozen_dtype: torch.dtype) -> dict[tuple[int, str], ExternalRegion]:
    """The offloaded frozen regions that can be read from the model's own safetensors files (a
    model from tinypipe's streaming loader whose frozen parameters still hold the file's values;
    :mod:`tinypipe.storage.frozen_source`); the others get a scratch copy."""
    wanted = [layer for layer, name in regions if name == "frozen"]
    if not wanted:
        return {}
    files = FileHandles()
    try:
        out = {}
        for layer in wanted:
            ext = frozen_region(dec.layers[layer], named, frozen_dtype, files)
            if ext is not None:
                out[(layer, "frozen")] = ext
        return out
    finally:
        files.close()


def offload_regions(dec: Decomposition, offload: Mapping[int, frozenset[str]], frozen_dtype: torch.dtype,
             retain_grad: bool) -> dict[tuple[int, str], tuple[int, torch.dtype]]:
    """The SSD regions (numel, dtype) of ``offload``'s kinds; kinds a layer does not have (a
    gradient that is not retained, frozen weights of a fully trainable layer) take none."""
    out: dict[tuple[int, str], tuple[int, torch.dtype]] = {}
    for layer in sorted(offload):
        spec = dec.layers[layer]
        for kind in sorted(offload[layer]):
            if kind == "grad" and not retain_grad:
                continue
            for name in REGIONS_OF[kind]:
                numel, dtype = (spec.frozen_numel, frozen_dtype) if name == "frozen" else (spec.train_numel,
                                                                                            torch.float32)
                if numel:
                    out[(layer, name)] = (numel, dtype)
    return out


def _placeholder(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Stands in for a tensor that lives on the SSD: right shape and dtype, no memory, loud on use."""
    return torch.empty(numel, dtype=dtype, device="meta")


def _dram_bytes(t: torch.Tensor) -> int:
    return 0 if t.device.type == "meta" else t.numel() * t.element_size()


def _params_to_meta(spec: LayerSpec, named: dict[str, nn.Parameter], trainable: bool) -> None:
    """Turn the model's parameters of ``spec`` (trainable or frozen ones) into meta tensors in
    place (every alias sees it), freeing their DRAM: their values live on the SSD now."""
    for p in spec.params:
        if p.trainable != trainable:
            continue
        param = named[p.name]
        stand_in = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                requires_grad=param.requires_grad)
        torch.utils.swap_tensors(param, stand_in)


class _SpillBuffers:
    """One reusable page-aligned buffer per kind for layers written to the SSD at start-up (the
    largest layer so far; a layer's buffer is free again once it is written)."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._bufs.get(kind)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = aligned_empty(max(numel, 1), dtype)
            self._bufs[kind] = buf
        return buf[:numel]


def release_freed_memory() -> None:
    """Give memory freed back to the OS now (glibc's ``malloc_trim``; nothing elsewhere).

    The model's parameters are many mid-sized allocations: glibc serves most of them from its heap
    (its mmap threshold rises as the first large blocks are freed), and freed heap memory stays
    resident until trimmed. Measured on a 19 M-parameter model whose state moved to the SSD: RSS
    stayed 77 MB (all of the model's fp32 weights) above where it belonged until this call."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        return
    if trim is not None:
        trim(0)
