"""Model presets (the public architectures' config.json fields) and config loading for the planner.

``load_model_config`` accepts a preset name (case-insensitive; a Hugging Face hub id of the same
model works too, e.g. ``meta-llama/Llama-2-7b-hf``), a model directory holding ``config.json``,
or a ``config.json`` path. Nothing is downloaded and no weights are read.
"""

from __future__ import annotations

import json
from pathlib import Path

import transformers

from tinypipe.errors import ConfigError


def _llama(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tied: bool, max_pos: int,
           rope_theta: float = 10000.0, **extra: object) -> dict:
    return dict(model_type="llama", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tied,
                max_position_embeddings=max_pos, rope_theta=rope_theta, rms_norm_eps=1e-5, hidden_act="silu",
                **extra)


_LLAMA3_ROPE = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
_LLAMA31_ROPE = dict(_LLAMA3_ROPE, factor=8.0)


def _qwen2(hidden: int, layers: int, heads: int, kv: int, inter: int, tied: bool = False) -> dict:
    # Qwen2 attention has q/k/v biases by construction (Qwen2Attention: bias=True)
    return dict(model_type="qwen2", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, intermediate_size=inter, vocab_size=152064, tie_word_embeddings=tied,
                max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
                use_sliding_window=False, sliding_window=131072, max_window_layers=layers, hidden_act="silu")


def _qwen3(hidden: int, layers: int, heads: int, kv: int, inter: int, tied: bool = False) -> dict:
    return dict(model_type="qwen3", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=128, intermediate_size=inter, vocab_size=151936,
                tie_word_embeddings=tied, max_position_embeddings=40960, rope_theta=1000000.0,
                rms_norm_eps=1e-6, use_sliding_window=False, max_window_layers=layers, attention_bias=False,
                hidden_act="silu")


def _opt(hidden: int, layers: int, heads: int, ffn: int) -> dict:
    return dict(model_type="opt", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                ffn_dim=ffn, vocab_size=50272, word_embed_proj_dim=hidden, max_position_embeddings=2048,
                do_layer_norm_before=True, tie_word_embeddings=True, pad_token_id=1, bos_token_id=2,
                eos_token_id=2, activation_function="relu", enable_bias=True,
                layer_norm_elementwise_affine=True)


#: Preset name -> config.json fields of the public architecture (random init; shapes only).
PRESETS: dict[str, dict] = {
    "llama-2-7b": _llama(4096, 32, 32, 32, 11008, 32000, False, 4096),
    "llama-2-13b": _llama(5120, 40, 40, 40, 13824, 32000, False, 4096),
    "llama-2-70b": _llama(8192, 80, 64, 8, 28672, 32000, False, 4096),
    "llama-30b": _llama(6656, 60, 52, 52, 17920, 32000, False, 2048),  # LLaMA-1 "30B" (32.5 B)
    "llama-3.1-8b": _llama(4096, 32, 32, 8, 14336, 128256, False, 131072, 500000.0,
                           rope_scaling=_LLAMA31_ROPE),
    "llama-3.1-70b": _llama(8192, 80, 64, 8, 28672, 128256, False, 131072, 500000.0,
                            rope_scaling=_LLAMA31_ROPE),
    "llama-3.2-1b": _llama(2048, 16, 32, 8, 8192, 128256, True, 131072, 500000.0, head_dim=64,
                           rope_scaling=_LLAMA3_ROPE),
    "llama-3.2-3b": _llama(3072, 28, 24, 8, 8192, 128256, True, 131072, 500000.0, head_dim=128,
                           rope_scaling=_LLAMA3_ROPE),
    "qwen2.5-7b": _qwen2(3584, 28, 28, 4, 18944),
    "qwen2.5-14b": _qwen2(5120, 48, 40, 8, 13824),
    "qwen2.5-32b": _qwen2(5120, 64, 40, 8, 27648),
    "qwen2.5-72b": _qwen2(8192, 80, 64, 8, 29568),
    "qwen3-8b": _qwen3(4096, 36, 32, 8, 12288),
    "qwen3-32b": _qwen3(5120, 64, 64, 8, 25600),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
                       tie_word_embeddings=False, max_position_embeddings=32768, sliding_window=4096,
                       rope_theta=10000.0, rms_norm_eps=1e-5, hidden_act="silu"),
    "gpt2-xl": dict(model_type="gpt2", n_embd=1600, n_layer=48, n_head=25, n_positions=1024, vocab_size=50257,
                    n_inner=None, activation_function="gelu_new", tie_word_embeddings=True,
                    bos_token_id=50256, eos_token_id=50256),
    "opt-13b": _opt(5120, 40, 40, 20480),
    "opt-30b": _opt(7168, 48, 56, 28672),
}

#: Other spellings (hub ids are matched by their last path part, lowercased, without -hf).
ALIASES = {
    "gpt-2-xl": "gpt2-xl",
    "mistral-7b-v0.1": "mistral-7b",
    "meta-llama-3.1-8b": "llama-3.1-8b",
    "meta-llama-3.1-70b": "llama-3.1-70b",
    "llama-2-7b-chat": "llama-2-7b",
    "llama-2-13b-chat": "llama-2-13b",
    "llama-2-70b-chat": "llama-2-70b",
}
_SUFFIXES = ("-hf", "-instruct", "-chat", "-base")


def preset_names() -> list[str]:
    return list(PRESETS)


def _preset_key(name: str) -> str | None:
    key = name.strip().lower()
    if "/" in key:
        key = key.rsplit("/", 1)[1]
    for _ in range(2):
        if key in PRESETS:
            return key
        if key in ALIASES:
            return ALIASES[key]
        for suf in _SUFFIXES:
            if key.endswith(suf):
                key = key[: -len(suf)]
    return key if key in PRESETS else ALIASES.get(key)


def config_from_dict(d: dict, where: str = "config") -> transformers.PretrainedConfig:
    """An HF config object from config.json fields (``model_type`` required)."""
    d = dict(d)
    model_type = d.pop("model_type", None)
    if not model_type:
        raise ConfigError(f"{where}: no model_type field")
    d.pop("transformers_version", None)
    try:
        return transformers.AutoConfig.for_model(model_type, **d)
    except (ValueError, KeyError):
        raise ConfigError(f"{where}: model_type {model_type!r} is unknown to transformers "
                          f"{transformers.__version__}") from None
    except Exception as exc:  # noqa: BLE001 - the config class rejected a field: one line
        first = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ConfigError(f"{where}: invalid {model_type} config: {first}") from None


def preset_config(name: str) -> transformers.PretrainedConfig:
    key = _preset_key(name)
    if key is None:
        raise ConfigError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    return config_from_dict(PRESETS[key], f"preset {key}")


def load_model_config(spec: str) -> transformers.PretrainedConfig:
    """A preset name, a Hugging Face model directory or a config.json path -> config (no weights).

    Unknown names raise one-line :class:`ConfigError` listing the presets.
    """
    text = str(spec).strip()
    if not text:
        raise ConfigError("no model given; use a model directory, a config.json or a preset: "
                          f"{', '.join(PRESETS)}")
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{spec}: directory has no config.json")
    if path.is_file():
        try:
            d = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return config_from_dict(d, str(path))
    if _preset_key(text) is not None:
        return preset_config(text)
    raise ConfigError(f"unknown model {spec!r} (not a model directory, a config.json or a preset); "
                      f"presets: {', '.join(PRESETS)}")
