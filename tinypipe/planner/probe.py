"""Small probe models built from a config, and what autograd saves on them.

A model's widths are read from its config (:func:`shape_of`); a *probe* is a model of the same
class with every width divided by a power of two (:func:`probe_config`: hidden, intermediate, head
dim; same head counts; a few layers; a tiny vocabulary), built on the CPU or the meta device
without initialising weights (:func:`build_model`). The planner's sizes run the runtime's own
decomposition on one (:mod:`tinypipe.planner.sizes`), and measure on it what autograd saves for one
block per token (:func:`act_per_token`), which the memory estimator scales back to the real widths.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import TYPE_CHECKING, Callable

import torch
import transformers
from torch import nn

from tinypipe.errors import ConfigError, UnsupportedModelError
from tinypipe.models.compact import saved_output_bytes
from tinypipe.models.decompose import Decomposition
from tinypipe.models.shell import Shell

if TYPE_CHECKING:
    from tinypipe.lora.settings import LoraSettings

#: Config attributes holding widths that scale with the hidden size (the probe divides them).
_WIDTH_ATTRS = ("hidden_size", "intermediate_size", "ffn_dim", "n_inner", "head_dim", "word_embed_proj_dim",
                "moe_intermediate_size", "shared_expert_intermediate_size")
_TOKEN_ATTRS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")
PROBE_VOCAB = 128
PROBE_BATCH, PROBE_SEQ = 2, 16


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


def set_layers(cfg: transformers.PretrainedConfig, n: int) -> None:
    cfg.num_hidden_layers = n
    for attr in ("layer_types", "mlp_only_layers"):
        v = getattr(cfg, attr, None)
        if isinstance(v, list) and len(v) > n:
            setattr(cfg, attr, v[:n])
    if isinstance(getattr(cfg, "max_window_layers", None), int):
        cfg.max_window_layers = min(cfg.max_window_layers, n)


def probe_scale(cfg: transformers.PretrainedConfig) -> int:
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
    set_layers(c, layers)
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


def build_model(cfg: transformers.PretrainedConfig, device: str, dtype: torch.dtype) -> nn.Module:
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


def probe_model(cfg: transformers.PretrainedConfig, dtype: torch.dtype,
                lora: LoraSettings | None = None) -> nn.Module:
    """A model of ``cfg`` on the CPU with small random weights (what is measured on it does not
    depend on their values), wrapped with ``lora``'s adapters over a dense base when given (PEFT's
    inner model: a quantized base saves as a frozen dense one)."""
    model = build_model(cfg, "cpu", dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if lora is not None:
        from tinypipe.lora.hooks import split_peft
        from tinypipe.lora.settings import apply_lora

        _, model = split_peft(apply_lora(model, dataclasses.replace(lora, quantize=None)))
        model.to(dtype)
    return model


def _saved_bytes_per_token(cfg: transformers.PretrainedConfig, dtype: torch.dtype,
                           lora: LoraSettings | None = None) -> tuple[float, float, float]:
    """Bytes autograd saves per token for block 0 of a (probe-sized) model, excluding its input
    and its parameters: what the backward pass holds for one recomputed block, and what a kept
    block saves in the compact form (models/compact.py) -- both from one forward -- and, from a
    second forward with the MLP in chunks of a quarter of the tokens (models/chunked_mlp.py), what
    a recomputed block saves then (the MLP's input, not its intermediates). ``lora``: with
    PEFT's adapters on a dense base (frozen base weights save no inputs for their gradients, the
    adapters add their own intermediates; a quantized base saves as a frozen dense one)."""
    model = probe_model(cfg, dtype, lora)
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


def act_formula(shape: dict[str, int], precision: str) -> float:
    """Fallback when no probe can run: a gated-MLP decoder block (measured on Llama: 24*H + 8*I
    bytes per token in bf16, fp32 norms included)."""
    h, i = shape["hidden"], shape["intermediate"]
    return float(24 * h + 8 * i) * (2.0 if precision == "fp32" else 1.0)


def act_per_token(cfg: transformers.PretrainedConfig, scale: int, precision: str,
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
        scale = lora_probe_scale(cfg, scale, lora.rank)
    if shape_of(cfg)["hidden"] <= 1024 or (lora is not None and scale < 4):
        return _saved_bytes_per_token(probe_config(cfg, 1, layers=1), dtype, lora)
    if scale < 4:
        raise UnsupportedModelError("widths do not scale down")
    one = _saved_bytes_per_token(probe_config(cfg, scale, layers=1), dtype, lora)
    two = _saved_bytes_per_token(probe_config(cfg, scale // 2, layers=1), dtype, lora)
    full, compact, chunked = (max((b2 - b1) * scale + max(2 * b1 - b2, 0.0), b1) for b1, b2 in zip(one, two))
    return full, compact, chunked


def lora_probe_scale(cfg: transformers.PretrainedConfig, scale: int, rank: int) -> int:
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
