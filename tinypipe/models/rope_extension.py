"""Context extension: scale a model's rotary position embedding so it reaches a longer sequence.

A model is trained for positions up to ``max_position_embeddings``; fine-tuning on longer rows
needs its RoPE frequencies stretched first, or the new positions rotate by angles the model never
saw. ``tinypipe finetune --extend-context`` (and ``tinypipe plan --extend-context``) apply the
standard scaling for the model's kind of RoPE, on the config before the model is built (the
rotary tables are computed at construction), so the saved model's ``config.json`` carries it and
reloads with the same positions:

* plain RoPE -> YaRN (Peng et al., 2023) with ``factor = tokens / max_position_embeddings`` and
  the old length as ``original_max_position_embeddings``: high frequencies kept, low ones
  interpolated, attention temperature adjusted -- what Qwen and DeepSeek ship for long context;
* ``llama3`` (Llama 3.1+), ``yarn``, ``linear`` -> the same scheme with its factor multiplied by
  the ratio (its own ``original_max_position_embeddings`` kept: the pre-training length);
* ``dynamic`` (NTK) -> the range raised alone (it rescales itself beyond the original length).

transformers computes the frequencies (``ROPE_INIT_FUNCTIONS``); this module only writes the
parameters it reads.
"""

from __future__ import annotations

from typing import Any

from tinypipe.errors import ConfigError

#: RoPE kinds whose ``factor`` stretches the positions it covers.
FACTOR_KINDS = ("llama3", "yarn", "linear")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE parameters (transformers 5 ``rope_parameters``; older ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = getattr(config, "rope_scaling", None)
    return dict(params or {})


def rope_kind(params: dict[str, Any]) -> str:
    """The RoPE type of ``params`` ("default" for plain RoPE; older configs say ``type``)."""
    return str(params.get("rope_type", params.get("type", "default")))


def describe_rope(config: Any) -> str:
    """The positions a model reaches and the RoPE scaling that gets it there, in one phrase."""
    params = rope_parameters(config)
    scale = f", factor {params['factor']:g}" if "factor" in params else ""
    base = params.get("original_max_position_embeddings")
    return (f"{config.max_position_embeddings:,} positions (RoPE {rope_kind(params)}{scale}"
            + (f" over {base:,}" if base else "") + ")")


def extend_rope(config: Any, tokens: int) -> str:
    """Scale ``config``'s RoPE in place so positions reach ``tokens``; a one-line description of
    what changed ("" when the model already reaches ``tokens``). ConfigError (one line) for a model
    without rotary positions or with a RoPE kind this does not scale."""
    old = getattr(config, "max_position_embeddings", None)
    if not isinstance(old, int):
        raise ConfigError(f"{getattr(config, 'model_type', 'this model')}: no max_position_embeddings to "
                          "extend (learned or absent positions); --extend-context scales rotary embeddings")
    if tokens <= old:
        return ""
    params = rope_parameters(config)
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{config.model_type}: RoPE set per layer type ({', '.join(params)}); "
                          "--extend-context scales one RoPE per model")
    if not params and not hasattr(config, "rope_theta"):
        raise ConfigError(f"{config.model_type}: no rotary position embedding to extend")
    kind = rope_kind(params)
    ratio = tokens / old
    if kind == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", None))
        params = {"rope_type": "yarn", "factor": ratio, "original_max_position_embeddings": old}
        if theta is not None:
            params["rope_theta"] = theta
        what = f"YaRN x{ratio:g} over the original {old:,}"
    elif kind in FACTOR_KINDS:
        before = float(params.get("factor", 1.0))
        params["factor"] = before * ratio
        what = f"{kind} factor {before:g} -> {params['factor']:g}"
    elif kind == "dynamic":
        what = "dynamic NTK (rescales itself)"
    else:
        raise ConfigError(f"{config.model_type}: RoPE type {kind!r} is not one --extend-context scales "
                          f"({', '.join(('default',) + FACTOR_KINDS + ('dynamic',))})")
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = params
    else:
        config.rope_scaling = params
    config.max_position_embeddings = tokens
    return f"RoPE extended from {old:,} to {tokens:,} positions: {what}"
