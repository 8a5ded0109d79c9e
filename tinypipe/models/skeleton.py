"""Build a model without its weights, then give it tinypipe's host layout before any weight is read.

Loading a checkpoint the usual way materialises the whole model, after which the engine copies it
into its per-layer fp32 master buffers: two copies of the weights at the peak. Here instead:

1. :func:`build_skeleton` constructs the model from its config with every *parameter* on the meta
   device (no memory) while *buffers* are created for real on the CPU by the model's own
   ``__init__`` -- non-persistent buffers such as rotary ``inv_freq`` are never in a checkpoint,
   so they must come out of the constructor correct;
2. :func:`decompose_skeleton` finds the layer structure (:class:`Decomposition`) on it: the probe
   runs the trunk's forward, which cannot run on meta tensors (masks call ``.item()``), so every
   parameter is temporarily replaced by a zero-stride CPU tensor of its shape (one element of
   memory each);
3. :class:`LayerMaterialiser` allocates each layer's fp32 master buffer exactly as the
   :class:`~tinypipe.memory.host_store.HostStore` lays it out and points the model's parameters
   at views of it. A reader then writes each checkpoint tensor straight into its view.

The store later recognises the parameters already in place and adopts the buffers without a
copy, so the peak host memory of a load is the final master weights plus one tensor in flight.
"""

from __future__ import annotations

import contextlib
import copy
import re
from typing import Iterator

import torch
from torch import nn

from tinypipe.devices.host_buffers import aligned_empty
from tinypipe.models.decompose import Decomposition
from tinypipe.models.placement import IN_PLACE_MARK, zero_gaps

__all__ = ["LayerMaterialiser", "build_skeleton", "decompose_skeleton", "empty_parameters"]


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """While active, every parameter registered on any module is moved to the meta device.

    Buffers are untouched (they are created on the CPU as usual). ``nn.Linear`` and friends
    allocate their weight with ``torch.empty`` before registering it: that memory is never
    touched and is freed at once, so it costs no resident memory. Not thread-safe: it patches
    ``nn.Module.register_parameter`` for the duration.
    """
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        p = self._parameters.get(name)
        if p is not None and not p.is_meta:
            self._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_skeleton(config) -> nn.Module:  # noqa: ANN001 - a transformers PretrainedConfig
    """The causal LM of ``config`` with meta parameters and real CPU buffers, fp32, eval mode, tied."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.dtype = torch.float32
    with empty_parameters():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()
    model.eval()
    return model


def _swap_parameters(model: nn.Module, make) -> dict[int, nn.Parameter]:  # noqa: ANN001
    """Replace every parameter by ``make(p)`` (shared parameters stay shared); returns new id -> old."""
    new_for: dict[int, nn.Parameter] = {}
    old_for: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in new_for:
                new_for[id(p)] = make(p)
                old_for[id(new_for[id(p)])] = p
            module._parameters[key] = new_for[id(p)]
    return old_for


def decompose_skeleton(model: nn.Module) -> Decomposition:
    """:class:`Decomposition` of a model whose parameters are on the meta device."""

    def stand_in(p: nn.Parameter) -> nn.Parameter:
        return nn.Parameter(torch.zeros((), dtype=torch.float32).expand(p.shape),
                            requires_grad=p.requires_grad)

    old_for = _swap_parameters(model, stand_in)
    try:
        return Decomposition(model)
    finally:
        _swap_parameters(model, lambda p: old_for[id(p)])


class LayerMaterialiser:
    """Per-layer fp32 master buffers for ``model``, its parameters re-pointed at views of them.

    ``target(key)`` resolves a checkpoint key (canonical name, tied alias, persistent buffer,
    with or without the model's base prefix) to the tensor it fills. Nothing is read here.
    """

    def __init__(self, model: nn.Module, decomposition: Decomposition) -> None:
        self.model = model
        self.decomposition = decomposition
        self.masters: list[torch.Tensor] = []
        self.views: dict[str, torch.Tensor] = {}
        for spec in decomposition.layers:
            master = aligned_empty(spec.numel, torch.float32)
            zero_gaps(spec, master)  # the checkpoint fills the rest
            for p in spec.params:
                self.views[p.name] = master[p.offset : p.offset + p.numel].view(p.shape)
            self.masters.append(master)
        self._bind()
        model.__dict__[IN_PLACE_MARK] = True  # the engine's HostStore adopts these buffers (no copy)
        # checkpoint key -> canonical parameter name (aliases map to their canonical name)
        self._param_keys: dict[str, str] = {}
        for canon, names in decomposition.aliases.items():
            for n in names:
                self._param_keys[n] = canon
        self._buffer_keys: dict[str, torch.Tensor] = {}
        for mod_name, module in model.named_modules():
            for key, buf in module._buffers.items():
                if buf is not None and key not in module._non_persistent_buffers_set:
                    self._buffer_keys[f"{mod_name}.{key}" if mod_name else key] = buf
        prefix = getattr(model, "base_model_prefix", "") or ""
        self._alternatives: dict[str, str] = {}
        if prefix:
            for key in list(self._param_keys) + list(self._buffer_keys):
                if key.startswith(prefix + "."):
                    self._alternatives.setdefault(key[len(prefix) + 1 :], key)  # saved from the base model
                else:
                    self._alternatives.setdefault(f"{prefix}.{key}", key)
        patterns = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
        self._ignored = [re.compile(p) for p in patterns]

    def _bind(self) -> None:
        """Point every alias of every parameter at its master view (new Parameter objects)."""
        model = self.model
        for canon, names in self.decomposition.aliases.items():
            first = model.get_parameter(canon)
            param = nn.Parameter(self.views[canon], requires_grad=first.requires_grad)
            for n in names:
                path, _, attr = n.rpartition(".")
                module = model.get_submodule(path) if path else model
                module._parameters[attr] = param

    # -- key resolution ------------------------------------------------------------------------

    def resolve(self, key: str) -> str | None:
        """The model key (parameter alias or persistent buffer) that checkpoint ``key`` fills."""
        if key in self._param_keys or key in self._buffer_keys:
            return key
        return self._alternatives.get(key)

    def canonical(self, model_key: str) -> str | None:
        """Canonical parameter name of a resolved key (None for a buffer)."""
        return self._param_keys.get(model_key)

    def ignored(self, key: str) -> bool:
        return any(p.search(key) for p in self._ignored)

    def target(self, model_key: str) -> torch.Tensor:
        canon = self._param_keys.get(model_key)
        return self.views[canon] if canon is not None else self._buffer_keys[model_key]

    @property
    def parameter_names(self) -> list[str]:
        return list(self.views)

    @property
    def master_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.masters)

    @property
    def largest_layer_bytes(self) -> int:
        return max(m.numel() * m.element_size() for m in self.masters)


def plan_checkpoint_keys(mat: LayerMaterialiser, keys: list[str], where: str) -> dict[str, str]:
    """checkpoint key -> model key for every key to read; raises ``KeyError``-free one-line errors.

    A tied weight stored under both names is read once (under its canonical name when present).
    Returns the keys to read; raises :class:`ValueError` (one line, naming the key) for an
    unexpected key, a parameter stored twice, or missing parameters.
    """
    chosen: dict[str, tuple[str, str]] = {}  # canonical/buffer key -> (checkpoint key, model key)
    for key in keys:
        model_key = mat.resolve(key)
        if model_key is None:
            if mat.ignored(key):
                continue
            raise ValueError(
                f"{where}: unexpected weight {key!r}: {type(mat.model).__name__} has no such parameter "
                "(a checkpoint of another architecture or configuration?)"
            )
        target = mat.canonical(model_key) or model_key
        previous = chosen.get(target)
        if previous is None or (model_key == target and previous[1] != target):
            chosen[target] = (key, model_key)  # the canonical name wins over a tied alias
    missing = [n for n in mat.parameter_names if n not in chosen]
    if missing:
        shown = ", ".join(sorted(missing)[:3]) + (", ..." if len(missing) > 3 else "")
        raise ValueError(
            f"{where}: the checkpoint lacks {len(missing)} weight(s) the model needs ({shown}); "
            "they would be random: refusing to train"
        )
    return {ck: mk for ck, mk in chosen.values()}


def fill(target: torch.Tensor, source: torch.Tensor, key: str, where: str) -> None:
    """Copy (and cast) ``source`` into ``target``, checking the shape."""
    if tuple(source.shape) != tuple(target.shape):
        raise ValueError(
            f"{where}: weight {key!r} has shape {tuple(source.shape)}, "
            f"the model expects {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(source)
