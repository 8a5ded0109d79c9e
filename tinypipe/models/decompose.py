"""Generic decomposition of a Hugging Face causal LM into layers.

A model becomes ``[embedding, block 0, ..., block L-1, head]``:

* the *blocks* are the decoder-layer ``ModuleList`` (found as the list with the most parameters
  whose length equals the configured layer count); its parent is the *trunk*;
* the *embedding* is everything the trunk runs before the first block (token and position
  embeddings, rotary tables, masks, dropout), executed by calling the trunk's own ``forward``
  with the blocks replaced by capture modules -- so masks, positions and rotary embeddings are
  built by the model's own code for whatever transformers version is installed;
* the *head* is whatever the trunk runs after the last block (final norm, projections), then
  the output embedding, then the loss.

No per-architecture copies of model code: what runs is the installed model's code.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from tinypipe.errors import UnsupportedModelError
from tinypipe.models.blocks import find_blocks
from tinypipe.models.capture import Capture, Recorder, Stop
from tinypipe.models.quant_hooks import QuantHooks, holds_quantized

#: Element alignment of every parameter inside a layer's flat buffer (keeps device views aligned
#: for vectorised kernels: 64 elements = 128 bytes in bf16, 256 in fp32).
ALIGN = 64

#: Families whose decomposition is verified against plain PyTorch in the test suite.
VERIFIED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "opt")


class LayerKind(enum.Enum):
    EMBED = "embed"
    BLOCK = "block"
    HEAD = "head"


@dataclass(frozen=True)
class ParamSlice:
    """Where one parameter lives inside its layer's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    trainable: bool = True  # False: frozen (requires_grad=False, e.g. a LoRA base weight)
    #: a bitsandbytes-quantized frozen weight: its payload layout (tinypipe.quant.layout), stored
    #: as ``numel`` elements of the compute dtype and rebuilt by
    #: :meth:`~tinypipe.models.shell.Shell.bind`; else None
    packed: Any = None


@dataclass
class LayerSpec:
    """One swappable unit: its own parameters (flat layout) and parameters it borrows (tied)."""

    index: int
    kind: LayerKind
    name: str
    params: list[ParamSlice]
    numel: int
    borrowed: list[tuple[str, int]] = field(default_factory=list)
    #: trainable parameters fill ``[0, train_numel)`` of the flat layout, frozen ones the rest
    #: (full fine-tuning: ``train_numel == numel``)
    train_numel: int = -1

    def __post_init__(self) -> None:
        if self.train_numel < 0:
            self.train_numel = self.numel

    @property
    def param_count(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def trainable_params(self) -> list[ParamSlice]:
        return [p for p in self.params if p.trainable]

    @property
    def frozen_numel(self) -> int:
        return self.numel - self.train_numel


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _layout(index: int, kind: LayerKind, name: str, named: list[tuple[str, nn.Parameter]],
            packed: Mapping[str, Any] | None = None) -> LayerSpec:
    """Flat layout: trainable parameters first (in module order), then frozen ones, so a layer's
    trainable state (master weights, gradients, moments) is one contiguous prefix. A quantized
    weight (``packed``: name -> payload layout) takes its payload's size, as a flat 1-D slice."""
    params, offset = [], 0
    trainable = [(n, p) for n, p in named if p.requires_grad]
    frozen = [(n, p) for n, p in named if not p.requires_grad]
    for pname, p in trainable:
        params.append(ParamSlice(pname, tuple(p.shape), offset, p.numel(), True))
        offset += _aligned(p.numel())
    train_numel = offset
    for pname, p in frozen:
        lay = (packed or {}).get(pname)
        n = p.numel() if lay is None else lay.numel
        params.append(ParamSlice(pname, tuple(p.shape) if lay is None else (n,), offset, n, False, lay))
        offset += _aligned(n)
    return LayerSpec(index, kind, name, params, offset, train_numel=train_numel)


def _has_mask(call: Any, expected: torch.Tensor) -> bool:
    """Whether ``call`` holds an attention mask over ``expected``'s tokens, and every such mask
    allows exactly ``expected`` (bool masks: True = attend; additive ones: 0 = attend)."""
    n = expected.shape[0]
    found: list[torch.Tensor] = []
    map_tensors(call, lambda t: found.append(t) if t.ndim >= 2 and tuple(t.shape[-2:]) == (n, n) else None)
    if not found:
        return False
    for t in found:
        m = t.reshape(-1, n, n).cpu()
        allowed = m if m.dtype == torch.bool else m.float() > -1.0
        if not all(torch.equal(a, expected) for a in allowed):
            return False
    return True


def _check_supported(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(f"{type(model).__name__}: not a Hugging Face model (no .config)")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{type(model).__name__}: encoder-decoder models are not supported")
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            raise UnsupportedModelError(
                f"{type(model).__name__}: output-logit transform '{attr}' is not supported"
            )
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no output embeddings (lm_head); tinypipe trains causal LMs"
        )


class Decomposition:
    """The layer structure of one model, plus the probes that established it.

    ``quant``: the quantization layer's helpers (:data:`tinypipe.quant.hooks.HOOKS`), needed to lay
    out a model holding bitsandbytes weights and kept for its shells. Without them such a model
    is probed (``document_masks``, the stage order) but its :attr:`layers` are refused.
    """

    def __init__(self, model: nn.Module, quant: QuantHooks | None = None) -> None:
        _check_supported(model)
        self.quant = quant
        self.model_type: str = getattr(model.config, "model_type", type(model).__name__)
        blocks_path, blocks = find_blocks(model)
        if "." in blocks_path:
            self.trunk_path, self.blocks_attr = blocks_path.rsplit(".", 1)
        else:
            self.trunk_path, self.blocks_attr = "", blocks_path
        trunk = model.get_submodule(self.trunk_path)
        sig = inspect.signature(trunk.forward)
        if "input_ids" not in sig.parameters or "attention_mask" not in sig.parameters:
            raise UnsupportedModelError(
                f"{type(trunk).__name__}.forward takes no input_ids/attention_mask; "
                "cannot build the embedding stage"
            )
        head = model.get_output_embeddings()
        self.head_path = next(n for n, m in model.named_modules() if m is head)
        self.num_blocks = len(blocks)
        self.pre_names, self.post_names = self._probe_order(model, trunk, blocks)
        #: whether the trunk turns position ids restarting inside a row into per-document masks
        self.document_masks: bool = self._probe_document_masks(model, trunk, blocks)
        quantized = holds_quantized(model)
        # the quantized weights' payload layouts by name ({} without any)
        packed = quant.packed_layouts(model) if quantized and quant is not None else {}
        self._layers = (None if quantized and quant is None
                        else self._assign_params(model, trunk, blocks, head, packed))
        self.aliases = self._aliases(model)
        canonical = {id(p): n for n, p in model.named_parameters()}
        weight = getattr(head, "weight", None)
        self.head_weight_name: str | None = canonical.get(id(weight)) if weight is not None else None

    # -- construction helpers -------------------------------------------------------------

    def _probe_order(self, model: nn.Module, trunk: nn.Module,
                     blocks: nn.ModuleList) -> tuple[list[str], list[str]]:
        """Run the trunk once on two tokens with identity blocks, recording which children run
        before the blocks (embedding side) and after them (head side)."""
        recorder = Recorder(len(blocks), stop=False)
        captures = nn.ModuleList(Capture(recorder, i, b) for i, b in enumerate(blocks))
        handles = []
        for name, child in trunk.named_children():
            if name == self.blocks_attr:
                continue
            handles.append(child.register_forward_pre_hook(lambda m, a, n=name: recorder.order.append(n)))
        device = next(iter(model.parameters())).device
        ids = torch.tensor([[0, 1]], device=device)
        try:
            setattr(trunk, self.blocks_attr, captures)
            with torch.no_grad():
                trunk(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        except UnsupportedModelError:
            raise
        except Exception as exc:  # the model's own code failed on our probe
            raise UnsupportedModelError(
                f"{type(model).__name__}: probing the trunk's forward failed ({type(exc).__name__}: {exc})"
            ) from exc
        finally:
            setattr(trunk, self.blocks_attr, blocks)
            for h in handles:
                h.remove()
        order = recorder.order
        if "block0" not in order or f"block{len(blocks) - 1}" not in order:
            raise UnsupportedModelError(f"{type(model).__name__}: the trunk did not call every decoder block")
        first, last = order.index("block0"), order.index(f"block{len(blocks) - 1}")
        pre = [n for n in order[:first] if not n.startswith("block")]
        post = [n for n in order[last + 1 :] if not n.startswith("block")]
        if set(pre) & set(post):
            raise UnsupportedModelError(
                f"{type(model).__name__}: modules {sorted(set(pre) & set(post))} run both before and "
                "after the blocks"
            )
        return list(dict.fromkeys(pre)), list(dict.fromkeys(post))

    def _probe_document_masks(self, model: nn.Module, trunk: nn.Module, blocks: nn.ModuleList) -> bool:
        """Run the trunk on two packed documents of three and two tokens (position ids 0, 1, 2, 0, 1,
        no padding mask) and check that every block receives a mask letting each token see only the earlier
        tokens of its own document. transformers 5 builds such masks from position ids for most
        families (``masking_utils.find_packed_sequence_indices``), not for all (OPT)."""
        if "position_ids" not in inspect.signature(trunk.forward).parameters:
            return False
        recorder = Recorder(len(blocks), stop=True)
        captures = nn.ModuleList(Capture(recorder, i, b) for i, b in enumerate(blocks))
        device = next(iter(model.parameters())).device
        pos = torch.tensor([[0, 1, 2, 0, 1]], device=device)
        try:
            setattr(trunk, self.blocks_attr, captures)
            with torch.no_grad():
                trunk(input_ids=pos.clone(), attention_mask=None, position_ids=pos, use_cache=False)
        except Stop:
            pass
        except Exception:  # noqa: BLE001 - a trunk that cannot take these inputs builds no such masks
            return False
        finally:
            setattr(trunk, self.blocks_attr, blocks)
        doc = torch.tensor([0, 0, 0, 1, 1])
        expected = torch.ones(5, 5, dtype=torch.bool).tril() & (doc[:, None] == doc[None, :])
        return all(call is not None and _has_mask(call, expected) for call in recorder.calls)

    def _assign_params(self, model: nn.Module, trunk: nn.Module, blocks: nn.ModuleList,
                       head: nn.Module, packed: Mapping[str, Any]) -> list[LayerSpec]:
        prefix = f"{self.trunk_path}." if self.trunk_path else ""
        canonical = {id(p): n for n, p in model.named_parameters()}
        owner: dict[int, int] = {}

        def named(module: nn.Module, path: str) -> list[tuple[str, nn.Parameter]]:
            out = []
            for local, p in module.named_parameters():
                full = f"{path}.{local}" if path else local
                if id(p) not in owner and canonical.get(id(p)) == full:
                    out.append((full, p))
            return out

        embed_named: list[tuple[str, nn.Parameter]] = []
        for name in self.pre_names:
            embed_named += named(trunk.get_submodule(name), prefix + name)
        layers = [_layout(0, LayerKind.EMBED, "embed", embed_named, packed)]
        for _, p in embed_named:
            owner[id(p)] = 0
        for i, block in enumerate(blocks):
            bn = named(block, f"{prefix}{self.blocks_attr}.{i}")
            layers.append(_layout(i + 1, LayerKind.BLOCK, f"block.{i}", bn, packed))
            for _, p in bn:
                owner[id(p)] = i + 1
        head_named: list[tuple[str, nn.Parameter]] = []
        for name in self.post_names:
            head_named += named(trunk.get_submodule(name), prefix + name)
        for _, p in head_named:
            owner[id(p)] = self.num_blocks + 1
        head_own = named(head, self.head_path)
        head_named += head_own
        for _, p in head_own:
            owner[id(p)] = self.num_blocks + 1
        head_layer = _layout(self.num_blocks + 1, LayerKind.HEAD, "head", head_named, packed)
        for local, p in head.named_parameters():
            if owner.get(id(p)) not in (None, self.num_blocks + 1):
                head_layer.borrowed.append((canonical[id(p)], owner[id(p)]))
        layers.append(head_layer)
        missing = [n for n, p in model.named_parameters() if id(p) not in owner]
        if missing:
            raise UnsupportedModelError(
                f"{type(model).__name__}: parameters outside embedding/blocks/head: {', '.join(missing[:4])}"
            )
        if not layers[0].params:
            raise UnsupportedModelError(
                f"{type(model).__name__}: no embedding parameters found before the blocks")
        return layers

    @staticmethod
    def _aliases(model: nn.Module) -> dict[str, list[str]]:
        canonical = {id(p): n for n, p in model.named_parameters()}
        out: dict[str, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            out.setdefault(canonical[id(p)], []).append(n)
        return out

    # -- queries ----------------------------------------------------------------------------

    @property
    def layers(self) -> list[LayerSpec]:
        """``[embedding, block 0, ..., block L-1, head]``, each in its flat layout."""
        if self._layers is None:
            raise UnsupportedModelError(
                f"{self.model_type}: the model holds bitsandbytes-quantized weights; laying it out needs "
                "their payload sizes: Decomposition(model, quant=tinypipe.quant.hooks.HOOKS)")
        return self._layers

    @property
    def embed(self) -> LayerSpec:
        return self.layers[0]

    @property
    def head(self) -> LayerSpec:
        return self.layers[-1]

    @property
    def blocks(self) -> list[LayerSpec]:
        return self.layers[1:-1]

    @property
    def tied(self) -> bool:
        return bool(self.head.borrowed)

    def locate(self, name: str) -> tuple[int, ParamSlice]:
        """(owning layer index, slice) of canonical parameter ``name``."""
        for layer in self.layers:
            for p in layer.params:
                if p.name == name:
                    return layer.index, p
        raise KeyError(name)

    def param_index(self) -> dict[str, tuple[int, ParamSlice]]:
        """Canonical parameter name -> (owning layer, slice)."""
        return {p.name: (layer.index, p) for layer in self.layers for p in layer.params}


def map_tensors(obj: Any, fn: Any) -> Any:
    """Apply ``fn`` to every tensor inside nested tuples/lists/dicts, memoising shared tensors."""
    memo: dict[int, Any] = {}

    def go(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) not in memo:
                memo[id(x)] = fn(x)
            return memo[id(x)]
        if isinstance(x, tuple):
            return tuple(go(v) for v in x)
        if isinstance(x, list):
            return [go(v) for v in x]
        if isinstance(x, dict):
            return {k: go(v) for k, v in x.items()}
        return x

    return go(obj)


def slice_rows(obj: Any, lo: int, hi: int, batch: int) -> Any:
    """Rows ``lo:hi`` of every batch-major tensor (ndim >= 2 and first dim == batch); others kept."""
    if lo == 0 and hi == batch:
        return obj
    return map_tensors(obj, lambda t: t[lo:hi] if t.ndim >= 2 and t.shape[0] == batch else t)


def iter_param_names(layers: Iterable[LayerSpec]) -> Iterable[str]:
    for layer in layers:
        for p in layer.params:
            yield p.name
