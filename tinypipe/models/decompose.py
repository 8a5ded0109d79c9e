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

import copy
import enum
import inspect
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from tinypipe.errors import UnsupportedModelError
from tinypipe.models.blocks import find_blocks
from tinypipe.models.compact import CompactBlock
from tinypipe.models.segment_attention import (STARTS_KWARG, segment_attention_supported, segment_starts,
                                                use_segment_attention)

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
    #: as ``numel`` elements of the compute dtype and rebuilt by :meth:`Shell.bind`; else None
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
            packed: dict[str, Any] | None = None) -> LayerSpec:
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


def _packed_layouts(model: nn.Module) -> dict[str, Any]:
    """Payload layouts of the model's bitsandbytes-quantized weights ({} without any: then
    tinypipe.quant is not even imported)."""
    if not any(type(p).__module__.startswith("bitsandbytes") for p in model.parameters()):
        return {}
    from tinypipe.quant.model import packed_layouts

    return packed_layouts(model)


class _Stop(Exception):
    """Raised by the last capture module to end the trunk's forward after the blocks' inputs."""


class _Recorder:
    """Collects what the trunk passes to each block: the hidden states and the other arguments."""

    def __init__(self, count: int, stop: bool) -> None:
        self.count = count
        self.stop = stop
        self.hidden: torch.Tensor | None = None
        self.calls: list[tuple[tuple, dict] | None] = [None] * count
        self.order: list[str] = []


class _Capture(nn.Module):
    """Stands in for block ``index``: records its call and returns the hidden states unchanged."""

    def __init__(self, recorder: _Recorder, index: int, template: nn.Module) -> None:
        super().__init__()
        self._recorder = [recorder]  # list: keep it out of the module tree
        self.index = index
        for attr in ("attention_type", "layer_idx", "layer_type", "is_sliding"):
            if hasattr(template, attr) and not isinstance(getattr(template, attr), (nn.Module, torch.Tensor)):
                setattr(self, attr, getattr(template, attr))

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        rec = self._recorder[0]
        if args:
            hidden, rest = args[0], tuple(args[1:])
        else:
            kwargs = dict(kwargs)
            hidden, rest = kwargs.pop("hidden_states"), ()
        if self.index == 0:
            rec.hidden = hidden
        rec.calls[self.index] = (rest, dict(kwargs))
        rec.order.append(f"block{self.index}")
        if rec.stop and self.index == rec.count - 1:
            raise _Stop()
        return hidden


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
    """The layer structure of one model, plus the probes that established it."""

    def __init__(self, model: nn.Module) -> None:
        _check_supported(model)
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
        self.layers = self._assign_params(model, trunk, blocks, head)
        self.aliases = self._aliases(model)
        canonical = {id(p): n for n, p in model.named_parameters()}
        weight = getattr(head, "weight", None)
        self.head_weight_name: str | None = canonical.get(id(weight)) if weight is not None else None

    # -- construction helpers -------------------------------------------------------------

    def _probe_order(self, model: nn.Module, trunk: nn.Module,
                     blocks: nn.ModuleList) -> tuple[list[str], list[str]]:
        """Run the trunk once on two tokens with identity blocks, recording which children run
        before the blocks (embedding side) and after them (head side)."""
        recorder = _Recorder(len(blocks), stop=False)
        captures = nn.ModuleList(_Capture(recorder, i, b) for i, b in enumerate(blocks))
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
        recorder = _Recorder(len(blocks), stop=True)
        captures = nn.ModuleList(_Capture(recorder, i, b) for i, b in enumerate(blocks))
        device = next(iter(model.parameters())).device
        pos = torch.tensor([[0, 1, 2, 0, 1]], device=device)
        try:
            setattr(trunk, self.blocks_attr, captures)
            with torch.no_grad():
                trunk(input_ids=pos.clone(), attention_mask=None, position_ids=pos, use_cache=False)
        except _Stop:
            pass
        except Exception:  # noqa: BLE001 - a trunk that cannot take these inputs builds no such masks
            return False
        finally:
            setattr(trunk, self.blocks_attr, blocks)
        doc = torch.tensor([0, 0, 0, 1, 1])
        expected = torch.ones(5, 5, dtype=torch.bool).tril() & (doc[:, None] == doc[None, :])
        return all(call is not None and _has_mask(call, expected) for call in recorder.calls)

    def _assign_params(self, model: nn.Module, trunk: nn.Module, blocks: nn.ModuleList,
                       head: nn.Module) -> list[LayerSpec]:
        prefix = f"{self.trunk_path}." if self.trunk_path else ""
        canonical = {id(p): n for n, p in model.named_parameters()}
        owner: dict[int, int] = {}
        packed = _packed_layouts(model)

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


class Shell:
    """A parameter-less copy of the model for one compute device.

    Parameters are meta tensors until :meth:`bind` points them at views of a device buffer;
    buffers (rotary tables, masks) are real and live on the device. One shell per device entry,
    used by one thread, so binding never races.
    """

    def __init__(self, model: nn.Module, decomposition: Decomposition, device: torch.device,
                 dropout: bool = False, mlp_chunk_tokens: int = 0,
                 segment_attention: bool = False) -> None:
        memo: dict[int, Any] = {}
        # quantized weights (tinypipe.quant): rebuilt from a slot's payload bytes (once per slot)
        self._packed = {p.name: p.packed for s in decomposition.layers for p in s.params
                        if p.packed is not None}
        self._rebuilt: dict[tuple[str, int], Any] = {}  # (name, slot address) -> rebuilt parameter
        if self._packed:
            from tinypipe.quant.shell import shell_memo

            memo.update(shell_memo(model))
        for p in model.parameters():
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
        shell = copy.deepcopy(model, memo)
        for module in shell.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None:
                    module._buffers[name] = buf.to(device)
        if self._packed:
            from tinypipe.quant.shell import prepare_shell

            prepare_shell(shell, device, {lay.scheme for lay in self._packed.values()})
        self.model = shell
        # training mode applies the model's dropout; the engine replays its draws in the recompute
        self.set_dropout(dropout)
        self.device = device
        self.decomposition = decomposition
        trunk = shell.get_submodule(decomposition.trunk_path)
        self.trunk = trunk
        self.blocks: nn.ModuleList = getattr(trunk, decomposition.blocks_attr)
        self.recorder = _Recorder(len(self.blocks), stop=True)
        setattr(
            trunk,
            decomposition.blocks_attr,
            nn.ModuleList(_Capture(self.recorder, i, b) for i, b in enumerate(self.blocks)),
        )
        self.runners: list[Any] = list(self.blocks)  # what block_forward calls (eager or compiled)
        # what block_forward calls for a kept pack's recorded forward (models/compact.py)
        self.compact_runners: list[Any] = [CompactBlock(b) for b in self.blocks]
        self.compiled = False  # whether the runners go through torch.compile
        self.post = [trunk.get_submodule(n) for n in decomposition.post_names]
        self.lm_head = shell.get_submodule(decomposition.head_path)
        self._slots: dict[str, tuple[nn.Module, str]] = {}
        for canon, names in decomposition.aliases.items():
            for n in names:
                path, attr = n.rsplit(".", 1) if "." in n else ("", n)
                module = self._resolve(shell, path)
                self._slots.setdefault(canon, []).append((module, attr))  # type: ignore[attr-defined]
        #: tokens per chunk of the blocks' MLPs (0: unchunked; models/chunked_mlp.py). Wrapped after
        #: the parameter slots are resolved: they hold the MLP's own modules, which stay as they are
        self.mlp_chunk_tokens = int(mlp_chunk_tokens)
        if self.mlp_chunk_tokens > 0:
            from tinypipe.models.chunked_mlp import FOLDABLE, chunk_mlps, fold_norms

            chunk_mlps(self.blocks, self.mlp_chunk_tokens)
            if getattr(shell.config, "model_type", None) in FOLDABLE:
                for block in self.blocks:
                    fold_norms(block, self.mlp_chunk_tokens)
        #: whether blocks attend per document without dense masks (models/segment_attention.py):
        #: asked for long sequences and honoured for the families it supports
        self.segment_attention = bool(segment_attention) and segment_attention_supported(shell)
        if self.segment_attention:
            use_segment_attention(shell)

    def _resolve(self, shell: nn.Module, path: str) -> nn.Module:
        dec = self.decomposition
        blocks_prefix = f"{dec.trunk_path}.{dec.blocks_attr}." if dec.trunk_path else f"{dec.blocks_attr}."
        if path.startswith(blocks_prefix):
            rest = path[len(blocks_prefix):]
            idx, _, sub = rest.partition(".")
            block = self.blocks[int(idx)]
            return block.get_submodule(sub) if sub else block
        return shell.get_submodule(path)

    @property
    def dropout(self) -> bool:
        """Whether the shell runs in training mode (the model's dropout applied)."""
        return self.model.training

    @property
    def quantized(self) -> bool:
        """Whether the shell holds bitsandbytes weights (a QLoRA base)."""
        return bool(self._packed)

    def set_dropout(self, enabled: bool) -> None:
        """Training mode (``True``) or eval mode for every module, e.g. eval for a forward-only
        evaluation; compiled blocks compile one more graph per mode. Quantized base layers (QLoRA)
        stay in eval mode: they are frozen, and bitsandbytes' int8 kernel differs in training mode."""
        # the blocks left the module tree when the capture wrappers replaced them: set them too
        parts = [self.model, *getattr(self, "blocks", ())]
        for part in parts:
            part.train(enabled)
        if self._packed:
            from tinypipe.quant.shell import freeze_quantized_modes

            for part in parts:
                freeze_quantized_modes(part)

    def compile_blocks(self, backend: str, replay_random: bool = False) -> None:
        """Run the decoder blocks through torch.compile with ``backend`` (see models/compiled.py);
        ``replay_random``: their random ops must draw what eager ones draw."""
        from tinypipe.models.compiled import CompiledBlock

        self.runners = [CompiledBlock(b, backend, replay_random) for b in self.blocks]
        self.compact_runners = [CompiledBlock(CompactBlock(b), backend, replay_random) for b in self.blocks]
        self.compiled = True

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        """Point every alias of canonical parameter ``name`` at ``tensor`` (a quantized weight's
        payload: at bitsandbytes' parameter rebuilt as views of it)."""
        packed = self._packed.get(name)
        if packed is not None:  # rebuilt once per slot it lands in (~0.1 ms each), then reused
            key = (name, tensor.data_ptr())
            rebuilt = self._rebuilt.get(key)
            if rebuilt is None:
                rebuilt = self._rebuilt[key] = packed.rebuild(tensor)
            for module, attr in self._slots[name]:  # type: ignore[union-attr]
                packed.attach(module, attr, rebuilt)
            return
        for module, attr in self._slots[name]:  # type: ignore[union-attr]
            module._parameters[attr] = tensor  # type: ignore[assignment]

    # -- the three stages -------------------------------------------------------------------

    def embed_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      position_ids: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, list[tuple[tuple, dict]]]:
        """Hidden states entering block 0 and the arguments the trunk passes to every block
        (``position_ids``: given to the trunk, which derives positions and masks from them)."""
        rec = self.recorder
        rec.hidden, rec.calls, rec.order = None, [None] * rec.count, []
        extra = {} if position_ids is None else {"position_ids": position_ids}
        try:
            self.trunk(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
        except _Stop:
            pass
        if rec.hidden is None or any(c is None for c in rec.calls):
            raise UnsupportedModelError("the trunk's forward did not reach every decoder block")
        calls = list(rec.calls)
        if self.segment_attention:  # the trunk built no mask: every block gets the segments instead
            starts = segment_starts(input_ids, attention_mask, position_ids)
            calls = [(args, {**kwargs, STARTS_KWARG: starts}) for args, kwargs in calls]  # type: ignore[misc]
        return rec.hidden, calls  # type: ignore[return-value]

    def block_forward(self, index: int, hidden: torch.Tensor, call: tuple[tuple, dict],
                      compact: bool = False) -> torch.Tensor:
        """Block ``index`` on ``hidden``; ``compact``: saving only what models/compact.py keeps."""
        args, kwargs = call
        out = (self.compact_runners if compact else self.runners)[index](hidden, *args, **kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        for module in self.post:
            hidden = module(hidden)
        return self.lm_head(hidden)


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
