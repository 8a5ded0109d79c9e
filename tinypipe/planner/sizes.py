"""Exact per-layer sizes of a model from its config alone: no weights, no GPU, seconds for 70B+.

Two models are built from the config:

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

import contextlib
import copy
import dataclasses
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Callable

import torch
import transformers
from torch import nn

from tinypipe.errors import ConfigError, UnsupportedModelError
from tinypipe.models.compact import saved_output_bytes
from tinypipe.models.decompose import ALIGN, Decomposition
from tinypipe.models.shell import Shell

if TYPE_CHECKING:
    from tinypipe.lora.settings import LoraSettings

#: Config attributes holding widths that scale with the hidden size (the probe divides them).
_WIDTH_ATTRS = ("hidden_size", "intermediate_size", "ffn_dim", "n_inner", "head_dim", "word_embed_proj_dim",
                "moe_intermediate_size", "shared_expert_intermediate_size")
_TOKEN_ATTRS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")
PROBE_VOCAB = 128
PROBE_BATCH, PROBE_SEQ = 2, 16


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
        """What the MLP's intermediates add per token to a recomputed block's saved bytes: what a
        chunked MLP recomputes, one chunk at a time, in the backward."""
        return self.block_act_bytes(precision) - self.chunked_block_bytes(precision)

    def kept_block_bytes(self, precision: str) -> float:
        """Bytes per token one block of a kept pack holds from its forward to its backward: the
        compact set (models/compact.py), or the full graph with dropout or a QLoRA base (the
        runtime's choice, runtime/handlers.py)."""
        full = self.block_act_bytes(precision)
        if self.draws or self.quantize or precision not in self.kept_bytes_per_token:
            return full
        return min(full, float(self.kept_bytes_per_token[precision]))


# --------------------------------------------------------------------------- config helpers


def _cfg_int(cfg: transformers.PretrainedConfig, *names: str, default: int | None = None) -> int | None:
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return default


def shape_of(cfg: transformers.PretrainedConfig) -> dict[str, int]:
    """Hidden, intermediate, heads, kv heads, head dim, vocab and layers of a config."""
    hidden = _cfg_int(cfg, "hidden_size", "n_embd", "d_model")
    layers = _cfg_int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _cfg_int(cfg, "num_attention_heads", "n_head")
    vocab = _cfg_int(cfg, "vocab_size")
    if not hidden or not layers or not heads or not vocab:
        raise ConfigError(f"config of model_type {getattr(cfg, 'model_type', '?')!r} lacks hidden size, "
                          "layer count, head count or vocabulary size")
    inter = _cfg_int(cfg, "intermediate_size", "ffn_dim", "n_inner") or 4 * hidden
    kv = _cfg_int(cfg, "num_key_value_heads", default=heads) or heads
    head_dim = _cfg_int(cfg, "head_dim") or hidden // heads
    return dict(hidden=hidden, intermediate=inter, heads=heads, kv_heads=kv, head_dim=head_dim, vocab=vocab,
                layers=layers)


def _set_layers(cfg: transformers.PretrainedConfig, n: int) -> None:
    cfg.num_hidden_layers = n
    for attr in ("layer_types", "mlp_only_layers"):
        v = getattr(cfg, attr, None)
        if isinstance(v, list) and len(v) > n:
            setattr(cfg, attr, v[:n])
    if isinstance(getattr(cfg, "max_window_layers", None), int):
        cfg.max_window_layers = min(cfg.max_window_layers, n)


def _probe_scale(cfg: transformers.PretrainedConfig) -> int:
    """Largest power-of-two divisor (<= 64) of every width that keeps the head dim >= 4."""
    shape = shape_of(cfg)
    widths = [shape["hidden"], shape["head_dim"]]
    widths += [v for a in _WIDTH_ATTRS
               if isinstance(v := getattr(cfg, a, None), int) and not isinstance(v, bool)]
    for s in (64, 32, 16, 8, 4, 2):
        if all(w % s == 0 for w in widths) and shape["head_dim"] // s >= 4:
            return s
    return 1


def probe_config(cfg: transformers.PretrainedConfig, scale: int,
                 layers: int = 2) -> transformers.PretrainedConfig:
    """A small copy of ``cfg``: widths divided by ``scale``, ``layers`` blocks, a tiny vocabulary."""
    c = copy.deepcopy(cfg)
    for attr in _WIDTH_ATTRS:
        v = getattr(c, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            setattr(c, attr, v // scale)
    _set_layers(c, layers)
    c.vocab_size = PROBE_VOCAB
    for attr in _TOKEN_ATTRS:
        v = getattr(c, attr, None)
        if isinstance(v, int) and v >= PROBE_VOCAB:
            setattr(c, attr, None)
    for attr in ("sliding_window",):  # keep windows meaningful at the probe's short sequences
        v = getattr(c, attr, None)
        if isinstance(v, int) and v < PROBE_SEQ:
            setattr(c, attr, PROBE_SEQ)
    c._attn_implementation = "sdpa"
    return c


@contextlib.contextmanager
def _no_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older 5.x layouts
        from transformers.modeling_utils import no_init_weights  # type: ignore[no-redef]
    with no_init_weights():
        yield


def _build(cfg: transformers.PretrainedConfig, device: str, dtype: torch.dtype) -> nn.Module:
    try:
        try:
            with torch.device(device), _no_init():
                model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except Exception:  # noqa: BLE001 - a model without SDPA support: its eager attention
            if getattr(cfg, "_attn_implementation", None) != "sdpa":
                raise
            cfg = copy.deepcopy(cfg)
            cfg._attn_implementation = "eager"
            with torch.device(device), _no_init():
                model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - any failure of the model's own constructor: one line
        first = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise UnsupportedModelError(f"cannot build a causal LM for model_type "
                                    f"{getattr(cfg, 'model_type', '?')!r}: {first}") from exc
    if getattr(cfg, "tie_word_embeddings", False):
        model.tie_weights()
    return model


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


# --------------------------------------------------------------------------- activation probe


def _saved_bytes_per_token(cfg: transformers.PretrainedConfig, dtype: torch.dtype,
                           lora: LoraSettings | None = None) -> tuple[float, float, float]:
    """Bytes autograd saves per token for block 0 of a (probe-sized) model, excluding its input
    and its parameters: what the backward pass holds for one recomputed block, and what a kept
    block saves in the compact form (models/compact.py) -- both from one forward -- and, from a
    second forward with the MLP in chunks of a quarter of the tokens (models/chunked_mlp.py), what
    a recomputed block saves then (the MLP's input, not its intermediates). ``lora``: with
    PEFT's adapters on a dense base (frozen base weights save no inputs for their gradients, the
    adapters add their own intermediates; a quantized base saves as a frozen dense one)."""
    model = _build(cfg, "cpu", dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if lora is not None:
        from tinypipe.lora.hooks import split_peft
        from tinypipe.lora.settings import apply_lora

        _, model = split_peft(apply_lora(model, dataclasses.replace(lora, quantize=None)))
        model.to(dtype)
    dec = Decomposition(model)
    shell = Shell(model, dec, torch.device("cpu"))
    chunked = Shell(model, dec, torch.device("cpu"), mlp_chunk_tokens=PROBE_BATCH * PROBE_SEQ // 4)
    named = dict(model.named_parameters())
    param_ptrs = set()
    for name in dec.aliases:
        t = named[name].detach().requires_grad_(named[name].requires_grad or lora is None)
        param_ptrs.add(t.untyped_storage().data_ptr())
        shell.bind(name, t)
        chunked.bind(name, t)
    ids = torch.randint(0, PROBE_VOCAB, (PROBE_BATCH, PROBE_SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden, calls = shell.embed_forward(ids, None)
    x = hidden.detach().to(dtype).requires_grad_(True)
    skip = param_ptrs | {x.untyped_storage().data_ptr()}
    compact: list[int] = []
    with torch.enable_grad():
        full = saved_tensor_bytes(
            lambda: compact.append(saved_output_bytes(lambda: shell.block_forward(0, x, calls[0]))), skip)
        in_chunks = saved_tensor_bytes(lambda: chunked.block_forward(0, x, calls[0]), skip)
    tokens = PROBE_BATCH * PROBE_SEQ
    return full / tokens, compact[0] / tokens, in_chunks / tokens


def saved_tensor_bytes(run: Callable[[], object], skip: set[int]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``run`` executes, except
    the storages in ``skip`` (the input and the parameters, which exist anyway)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.device.type != "meta":
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(saved.values())


def config_draws(cfg: transformers.PretrainedConfig) -> bool:
    """Whether ``cfg`` sets a dropout probability above 0 (``attention_dropout``, ``resid_pdrop``,
    ``hidden_dropout_prob`` ...): its blocks then draw random numbers while training."""
    for key, value in cfg.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, (int, float)) and value > 0:
            return True
    return False


def _act_formula(shape: dict[str, int], precision: str) -> float:
    """Fallback when no probe can run: a gated-MLP decoder block (measured on Llama: 24*H + 8*I
    bytes per token in bf16, fp32 norms included)."""
    h, i = shape["hidden"], shape["intermediate"]
    return float(24 * h + 8 * i) * (2.0 if precision == "fp32" else 1.0)


def _act_per_token(cfg: transformers.PretrainedConfig, scale: int, precision: str,
                   lora: LoraSettings | None = None) -> tuple[float, float, float]:
    """Saved bytes per token of one real-size block: recomputed, kept in the compact form, and
    recomputed with its MLP in chunks.

    Small models are probed at their real widths. Larger ones are probed at widths /scale and
    /(scale/2): b(s) = A/s + C separates the width-proportional part A from the per-token constant
    C (norm statistics, attention log-sum-exp, LoRA's rank-wide intermediates), so A + C is the
    real block's figure. ``lora``: the block with adapters (the scale then keeps every projection
    that is a low-rank expansion at the real widths one at the probe's, models/compact.py).
    """
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if lora is not None:
        scale = _lora_probe_scale(cfg, scale, lora.rank)
    if shape_of(cfg)["hidden"] <= 1024 or (lora is not None and scale < 4):
        return _saved_bytes_per_token(probe_config(cfg, 1, layers=1), dtype, lora)
    if scale < 4:
        raise UnsupportedModelError("widths do not scale down")
    one = _saved_bytes_per_token(probe_config(cfg, scale, layers=1), dtype, lora)
    two = _saved_bytes_per_token(probe_config(cfg, scale // 2, layers=1), dtype, lora)
    full, compact, chunked = (max((b2 - b1) * scale + max(2 * b1 - b2, 0.0), b1) for b1, b2 in zip(one, two))
    return full, compact, chunked


def _lora_probe_scale(cfg: transformers.PretrainedConfig, scale: int, rank: int) -> int:
    """The largest power of two <= ``scale`` at which every projection width that is a low-rank
    expansion of ``rank`` at the real widths still is one (below 4: probe the real widths)."""
    from tinypipe.models.compact import LOW_RANK_RATIO

    shape = shape_of(cfg)
    widths = [shape["hidden"], shape["intermediate"], shape["heads"] * shape["head_dim"],
              shape["kv_heads"] * shape["head_dim"]]
    need = LOW_RANK_RATIO * rank
    while scale >= 4 and any(w >= need > w // scale for w in widths):
        scale //= 2
    return scale


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
    scale = _probe_scale(cfg)
    probe = _build(probe_config(cfg, scale, layers=2), "cpu", torch.float32)
    dec = Decomposition(probe)
    real_cfg = copy.deepcopy(cfg)
    real_cfg._attn_implementation = "sdpa"
    meta = _build(real_cfg, "meta", torch.float32)
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
            acts[precision], kept[precision], chunked[precision] = _act_per_token(cfg, scale, precision)
        except Exception:  # noqa: BLE001 - the probe is an estimate; any failure falls back to the formula
            acts[precision] = _act_formula(shape, precision)
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
            acts[precision], kept[precision], chunked[precision] = _act_per_token(
                cfg, _probe_scale(cfg), precision, settings)
    except Exception:  # noqa: BLE001 - an estimate: a probe that fails falls back to the base's figures
        return (dict(base.act_bytes_per_token), dict(base.kept_bytes_per_token),
                dict(base.chunked_bytes_per_token), "probe (full fine-tuning)")
    if len(_LORA_ACTS) > 64:
        _LORA_ACTS.clear()
    _LORA_ACTS[key] = out = (acts, kept, chunked, "probe")
    return out
