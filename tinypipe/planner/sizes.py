"""Exact per-layer sizes of a model from its config alone: no weights, no GPU, seconds for 70B+.

Two models are built from the config (:mod:`tinypipe.planner.probe`):

* a *meta* model (``torch.device("meta")``, weight init skipped): the real parameter shapes at no
  memory cost;
* a *probe* model of the same class with every width divided by a power of two (hidden,
  intermediate, head dim; same head counts; 2 layers; a tiny vocabulary) on the CPU. The runtime's
  own :class:`~tinypipe.models.decompose.Decomposition` runs on it, which says which trunk children
  run before the blocks (embedding side) and after them (head side), where the blocks and the
  output embedding live, and whether the head is tied. The same probe measures what autograd saves
  for one block per token (the recompute activations the backward pass keeps), which the memory
  estimator scales back to the real widths.

The names found on the probe are then applied to the meta model and each layer's flat size is
computed with the runtime's 64-element alignment per parameter, so the numbers equal
``Decomposition(real_model).layers[i].numel`` exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import transformers
from torch import nn

from tinypipe.errors import ConfigError, UnsupportedModelError
from tinypipe.models.decompose import ALIGN, Decomposition
from tinypipe.models.tiled_attention import ATTENTION_TILE_TOKENS
from tinypipe.planner.probe import (
    act_formula,
    act_per_token,
    build_model,
    config_draws,
    probe_config,
    probe_scale,
    shape_of,
)

if TYPE_CHECKING:
    from tinypipe.lora.settings import LoraSettings

_ELEM = {"bf16": 2, "fp32": 4}


def dtype_bytes(precision: str) -> int:
    """Bytes per element of the compute precision (``"bf16"`` or ``"fp32"``)."""
    try:
        return _ELEM[precision]
    except KeyError:
        raise ConfigError(f"precision must be 'bf16' or 'fp32', got {precision!r}") from None


def aligned(n: int) -> int:
    """``n`` rounded up to the runtime's per-parameter alignment (:data:`ALIGN` elements)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class ModelSizes:
    """What the planner needs to know about a model: exact flat sizes per layer, and shapes.

    ``*_numel`` are flat buffer sizes (aligned, what the runtime allocates); ``*_params`` are raw
    parameter counts. ``act_bytes_per_token`` maps a precision (``"bf16"``/``"fp32"``) to the
    bytes autograd saves per token for one block when a pack is recomputed for backward.
    """

    model_type: str
    num_blocks: int
    embed_numel: int
    head_numel: int
    block_numels: tuple[int, ...]
    embed_params: int
    head_params: int
    block_params: tuple[int, ...]
    tied: bool
    hidden: int
    vocab: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_matmul_params: int  # the output embedding's weight (counted once even when tied)
    pre_names: tuple[str, ...] = ()
    post_names: tuple[str, ...] = ()
    act_bytes_per_token: dict = field(default_factory=dict, compare=False)
    act_source: str = "probe"
    #: bytes per token a *kept* block saves in the compact form (models/compact.py: matmul and
    #: attention outputs), per precision; empty: as ``act_bytes_per_token``
    kept_bytes_per_token: dict = field(default_factory=dict, compare=False)
    #: bytes per token a recomputed block saves when its MLP runs in sequence chunks
    #: (models/chunked_mlp.py: the MLP's intermediates are not saved, one chunk's are recomputed in
    #: the backward), per precision; empty: as ``act_bytes_per_token``
    chunked_bytes_per_token: dict = field(default_factory=dict, compare=False)
    #: the config has dropout (a kept graph then saves in full, to hold its masks)
    draws: bool = False
    #: trainable elements per layer (runtime order) when some parameters are frozen (LoRA: the
    #: adapters); empty for full fine-tuning, where every element trains
    train_numels: tuple[int, ...] = ()
    lora: str = ""  # a description of the LoRA adapters these sizes include ("" = full fine-tuning)
    #: QLoRA: the quantized base's label (``nf4+dq``, tinypipe.quant) and the dense elements
    #: quantized per block (what the kernels dequantize every pass); "" / () for a dense base
    quantize: str = ""
    quant_block_params: tuple[int, ...] = ()
    #: the workload's documents: the token-weighted mean length of the documents packed into a
    #: sequence (each attends only within itself: models/segment_attention.py); 0: one per sequence
    document_tokens: int = 0
    #: tokens per attention tile of a segment longer than it under segment attention
    #: (``Config.attention_tile_tokens``, models/tiled_attention.py); 0: whole segments
    attention_tile: int = ATTENTION_TILE_TOKENS

    def attended_tokens(self, seq: int) -> int:
        """The causal span a token's attention covers on average, doubled (``seq`` for one document
        per sequence): attention's FLOPs per token are ``2 * attended_tokens * heads * head_dim``."""
        return min(seq, self.document_tokens) if self.document_tokens > 0 else seq

    @property
    def frozen_label(self) -> str:
        """The memory report's row for the frozen weights (``frozen_weights (nf4+dq)`` quantized)."""
        return f"frozen_weights ({self.quantize})" if self.quantize else "frozen_weights"

    # cached (the planner reads these millions of times per search): never mutate the lists
    @cached_property
    def layer_numels(self) -> list[int]:
        """Flat sizes in runtime layer order: embedding, blocks, head."""
        return [self.embed_numel, *self.block_numels, self.head_numel]

    @property
    def total_numel(self) -> int:
        return sum(self.layer_numels)

    @property
    def param_count(self) -> int:
        return self.embed_params + sum(self.block_params) + self.head_params

    @cached_property
    def layer_train_numels(self) -> list[int]:
        """Trainable elements per layer (runtime order): what has gradients and AdamW state."""
        return list(self.train_numels) if self.train_numels else self.layer_numels

    @property
    def train_total(self) -> int:
        return sum(self.layer_train_numels)

    @property
    def frozen_total(self) -> int:
        return self.total_numel - self.train_total

    @property
    def grad_slot_numel(self) -> int:
        """Elements of one device gradient accumulator slot: the largest block's trainable part."""
        return max(self.layer_train_numels[1:-1])

    @property
    def slot_numel(self) -> int:
        """Elements of one device layer slot: the largest block (what the engine allocates)."""
        return max(self.block_numels)

    def block_act_bytes(self, precision: str) -> float:
        """Bytes per token autograd keeps for one recomputed block (see the module doc)."""
        if precision not in self.act_bytes_per_token:
            raise ConfigError(f"precision must be 'bf16' or 'fp32', got {precision!r}")
        return float(self.act_bytes_per_token[precision])

    def chunked_block_bytes(self, precision: str) -> float:
        """Bytes per token one recomputed block saves with its MLP chunked (all tokens but the
        chunk being recomputed: see :meth:`mlp_bytes_per_token`)."""
        full = self.block_act_bytes(precision)
        return min(full, float(self.chunked_bytes_per_token.get(precision, full)))

    def mlp_bytes_per_token(self, precision: str) -> float:
        """What the MLP's intermediates (and the norms folded into the chunks, models/chunked_mlp.py
        ``fold_norms``) add per token to a recomputed block's saved bytes: what a chunked block
        recomputes, one chunk at a time, in the backward."""
        return self.block_act_bytes(precision) - self.chunked_block_bytes(precision)

    def kept_block_bytes(self, precision: str) -> float:
        """Bytes per token one block of a kept pack holds from its forward to its backward: the
        compact set (models/compact.py), or the full graph with dropout or a QLoRA base (the
        runtime's choice, runtime/compute_handlers.py)."""
        full = self.block_act_bytes(precision)
        if self.draws or self.quantize or precision not in self.kept_bytes_per_token:
            return full
        return min(full, float(self.kept_bytes_per_token[precision]))


# --------------------------------------------------------------------------- layer sizes


def _layer_sizes(model: nn.Module, dec: Decomposition) -> tuple[list[int], list[int], bool, int]:
    """(flat numel, raw param count) per layer of ``model`` using ``dec``'s names (found on a
    probe of the same class); mirrors Decomposition._assign_params: a parameter belongs to the
    first layer that reaches it under its canonical (first-seen) name."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    owner: dict[int, int] = {}
    prefix = f"{dec.trunk_path}." if dec.trunk_path else ""
    trunk = model.get_submodule(dec.trunk_path)
    blocks = getattr(trunk, dec.blocks_attr)
    head = model.get_submodule(dec.head_path)
    if not isinstance(blocks, nn.ModuleList):
        raise UnsupportedModelError(f"{type(model).__name__}: {dec.blocks_attr} is not a block list")

    def take(module: nn.Module, path: str, layer: int) -> tuple[int, int]:
        flat = raw = 0
        for local, p in module.named_parameters():
            full = f"{path}.{local}" if path else local
            if id(p) not in owner and canonical.get(id(p)) == full:
                owner[id(p)] = layer
                flat += aligned(p.numel())
                raw += p.numel()
        return flat, raw

    numels, raws = [], []
    f = r = 0
    for name in dec.pre_names:
        a, b = take(trunk.get_submodule(name), prefix + name, 0)
        f, r = f + a, r + b
    numels.append(f)
    raws.append(r)
    for i, block in enumerate(blocks):
        a, b = take(block, f"{prefix}{dec.blocks_attr}.{i}", i + 1)
        numels.append(a)
        raws.append(b)
    L1 = len(blocks) + 1
    f = r = 0
    for name in dec.post_names:
        a, b = take(trunk.get_submodule(name), prefix + name, L1)
        f, r = f + a, r + b
    a, b = take(head, dec.head_path, L1)
    numels.append(f + a)
    raws.append(r + b)
    missing = [n for n, p in model.named_parameters() if id(p) not in owner]
    if missing:
        raise UnsupportedModelError(f"{type(model).__name__}: parameters outside embedding/blocks/head: "
                                    f"{', '.join(missing[:4])}")
    tied = any(owner.get(id(p)) not in (None, L1) for p in head.parameters())
    weight = getattr(head, "weight", None)
    head_matmul = weight.numel() if weight is not None else 0
    return numels, raws, tied, head_matmul


# --------------------------------------------------------------------------- entry point


def _key(cfg: transformers.PretrainedConfig) -> str:
    d = cfg.to_dict()
    return json.dumps(d, sort_keys=True, default=str)


def model_sizes(cfg: transformers.PretrainedConfig) -> ModelSizes:
    """Exact flat sizes per layer and block activation bytes for ``cfg`` (cached per config)."""
    return _model_sizes_cached(_key(cfg), cfg)


_CACHE: dict[str, ModelSizes] = {}


def _model_sizes_cached(key: str, cfg: transformers.PretrainedConfig) -> ModelSizes:
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    out = _compute_sizes(cfg)
    if len(_CACHE) > 64:
        _CACHE.clear()
    _CACHE[key] = out
    return out


def _compute_sizes(cfg: transformers.PretrainedConfig) -> ModelSizes:
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"model_type {cfg.model_type!r}: encoder-decoder models are not "
                                    "supported")
    shape = shape_of(cfg)
    scale = probe_scale(cfg)
    probe = build_model(probe_config(cfg, scale, layers=2), "cpu", torch.float32)
    dec = Decomposition(probe)
    real_cfg = copy.deepcopy(cfg)
    real_cfg._attn_implementation = "sdpa"
    meta = build_model(real_cfg, "meta", torch.float32)
    numels, raws, tied, head_matmul = _layer_sizes(meta, dec)
    if len(numels) - 2 != shape["layers"]:
        raise UnsupportedModelError(f"model_type {cfg.model_type!r}: found {len(numels) - 2} blocks, "
                                    f"config says {shape['layers']}")
    acts: dict[str, float] = {}
    kept: dict[str, float] = {}
    chunked: dict[str, float] = {}
    source = "probe"
    for precision in ("bf16", "fp32"):
        try:
            acts[precision], kept[precision], chunked[precision] = act_per_token(cfg, scale, precision)
        except Exception:  # noqa: BLE001 - the probe is an estimate; any failure falls back to the formula
            acts[precision] = act_formula(shape, precision)
            kept.pop(precision, None)  # kept blocks then count as full graphs
            chunked.pop(precision, None)  # and chunked MLPs as unchunked ones
            source = "formula"
    return ModelSizes(
        model_type=str(getattr(cfg, "model_type", type(meta).__name__)),
        num_blocks=len(numels) - 2,
        embed_numel=numels[0],
        head_numel=numels[-1],
        block_numels=tuple(numels[1:-1]),
        embed_params=raws[0],
        head_params=raws[-1],
        block_params=tuple(raws[1:-1]),
        tied=tied,
        hidden=shape["hidden"],
        vocab=shape["vocab"],
        intermediate=shape["intermediate"],
        num_heads=shape["heads"],
        num_kv_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        head_matmul_params=head_matmul,
        pre_names=tuple(dec.pre_names),
        post_names=tuple(dec.post_names),
        act_bytes_per_token=acts,
        act_source=source,
        kept_bytes_per_token=kept,
        chunked_bytes_per_token=chunked,
        draws=config_draws(cfg),
    )


def lora_sizes(cfg: transformers.PretrainedConfig, settings: LoraSettings) -> ModelSizes:
    """:func:`model_sizes` of ``cfg`` with LoRA ``settings`` applied: the exact flat layouts the
    engine allocates for a PEFT-wrapped model (adapters trainable first, the frozen base after),
    from a meta-device skeleton -- no weights, seconds even for 70B models."""
    from tinypipe.lora.hooks import split_peft
    from tinypipe.lora.settings import apply_lora
    from tinypipe.models.skeleton import build_skeleton, decompose_skeleton

    base = model_sizes(cfg)
    real_cfg = copy.deepcopy(cfg)
    real_cfg._attn_implementation = "sdpa"
    # QLoRA: the adapters over the dense skeleton; the quantized payloads are sized below
    _, inner = split_peft(apply_lora(build_skeleton(real_cfg), dataclasses.replace(settings, quantize=None)))
    dec = decompose_skeleton(inner)
    numels = [spec.numel for spec in dec.layers]
    trains = [spec.train_numel for spec in dec.layers]
    if len(numels) != base.num_blocks + 2:
        raise UnsupportedModelError(f"LoRA changed the layer count of {base.model_type!r}")
    targets = settings.targets or "all block projections"
    quant = settings.quant_spec
    quantized: list[int] = []
    if quant is not None:  # QLoRA: the block linears' payloads (tinypipe.quant), exactly as allocated
        from tinypipe.quant.sizing import quantized_sizes

        numels, quantized = quantized_sizes(dec, inner, quant)
    acts, kept, chunked, source = _lora_activations(cfg, settings, base)
    return dataclasses.replace(
        base, embed_numel=numels[0], head_numel=numels[-1], block_numels=tuple(numels[1:-1]),
        train_numels=tuple(trains),
        lora=f"LoRA rank {settings.rank} on {targets if isinstance(targets, str) else ','.join(targets)}"
        + (f" over a {quant.label} base" if quant is not None else ""),
        quantize=quant.label if quant is not None else "", quant_block_params=tuple(quantized[1:-1]),
        draws=base.draws or settings.dropout > 0,
        act_bytes_per_token=acts, kept_bytes_per_token=kept, chunked_bytes_per_token=chunked,
        act_source=source,
    )


_LORA_ACTS: dict[str, tuple[dict, dict, dict, str]] = {}


def _lora_activations(cfg: transformers.PretrainedConfig, settings: LoraSettings,
                      base: ModelSizes) -> tuple[dict, dict, dict, str]:
    """Saved bytes per token of a block with ``settings``' adapters (full graph, compact set,
    chunked MLP), per
    precision: probed like the base's (cached per config and settings); where the probe cannot
    run, the base's figures (full fine-tuning's: frozen weights save less, adapters a little more)."""
    key = _key(cfg) + repr((settings.rank, settings.dropout, tuple(settings.targets or ())))
    hit = _LORA_ACTS.get(key)
    if hit is not None:
        return hit
    if base.act_source != "probe":
        return (dict(base.act_bytes_per_token), dict(base.kept_bytes_per_token),
                dict(base.chunked_bytes_per_token), base.act_source)
    acts: dict[str, float] = {}
    kept: dict[str, float] = {}
    chunked: dict[str, float] = {}
    try:
        for precision in ("bf16", "fp32"):
            acts[precision], kept[precision], chunked[precision] = act_per_token(
                cfg, probe_scale(cfg), precision, settings)
    except Exception:  # noqa: BLE001 - an estimate: a probe that fails falls back to the base's figures
        return (dict(base.act_bytes_per_token), dict(base.kept_bytes_per_token),
                dict(base.chunked_bytes_per_token), "probe (full fine-tuning)")
    if len(_LORA_ACTS) > 64:
        _LORA_ACTS.clear()
    _LORA_ACTS[key] = out = (acts, kept, chunked, "probe")
    return out
