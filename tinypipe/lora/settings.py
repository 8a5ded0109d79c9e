"""LoRA settings and attaching adapters to a Hugging Face causal LM with PEFT."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Sequence

from torch import nn

from tinypipe.errors import ConfigError, UnsupportedModelError


@dataclass
class LoraSettings:
    """What the LoRA adapters look like.

    * ``rank`` -- the adapters' inner dimension r (trainable parameters grow linearly with it).
    * ``alpha`` -- the scale numerator: updates are scaled by ``alpha / rank``.
    * ``dropout`` -- PEFT's ``lora_dropout`` on each adapter's input, applied while training (the
      backward recompute replays its masks; ``Config(dropout=False)`` turns it off with the
      model's own dropout) and recorded in ``adapter_config.json``.
    * ``targets`` -- names of the linear layers inside the decoder blocks to adapt (e.g.
      ``["q_proj", "v_proj"]``); None: every linear projection of attention and MLP.
    * ``quantize`` -- ``"nf4"`` / ``"fp4"`` / ``"int8"``: QLoRA, the frozen base's block linears
      quantized with bitsandbytes (:mod:`tinypipe.quant`); None: the base at compute precision.
    * ``double_quant`` -- 4-bit: quantize the block scales too (QLoRA's default).
    * ``compute_dtype`` -- ``"bf16"`` / ``"fp32"``: what the quantized layers compute in (the
      engine's precision must match).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: Sequence[str] | None = None
    quantize: str | None = None
    double_quant: bool = True
    compute_dtype: str = "bf16"

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):
            self.targets = [t.strip() for t in self.targets.split(",") if t.strip()]
        self.validate()

    def validate(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"lora_rank must be a whole number >= 1, got {self.rank!r}")
        for name in ("alpha", "dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"lora_{name} must be a finite number, got {value!r}")
        if not self.alpha > 0:
            raise ConfigError(f"lora_alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora_dropout must be in [0, 1), got {self.dropout}")
        if self.targets is not None:
            if not isinstance(self.targets, (list, tuple)) or not self.targets or not all(
                isinstance(t, str) and t.strip() for t in self.targets
            ):
                raise ConfigError(
                    f"lora_targets must be a non-empty list of module names, got {self.targets!r}")
            self.targets = [t.strip() for t in self.targets]
        self.quant_spec  # noqa: B018 - validates quantize / double_quant / compute_dtype

    @property
    def quant_spec(self):  # -> tinypipe.quant.QuantSpec | None
        """The :class:`~tinypipe.quant.QuantSpec` of ``quantize`` (None without quantization)."""
        if self.quantize is None:
            return None
        from tinypipe.quant.spec import spec_for

        return spec_for(self.quantize, self.compute_dtype, double_quant=self.double_quant)


def _linear_types() -> tuple[type, ...]:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers without GPT-2's Conv1D
        return (nn.Linear,)
    return (nn.Linear, Conv1D)


def block_linears(model: nn.Module) -> dict[str, list[str]]:
    """Leaf name (``q_proj``) -> full module names of the linear layers inside the decoder blocks."""
    from tinypipe.models.blocks import find_blocks

    path, blocks = find_blocks(model)
    out: dict[str, list[str]] = {}
    kinds = _linear_types()
    for i, block in enumerate(blocks):
        for name, m in block.named_modules():
            if name and isinstance(m, kinds):
                out.setdefault(name.rsplit(".", 1)[-1], []).append(f"{path}.{i}.{name}")
    return out


def default_targets(model: nn.Module) -> list[str]:
    """Every linear projection in the decoder blocks (attention and MLP), by leaf name."""
    return list(block_linears(model))


def apply_lora(model: nn.Module, settings: LoraSettings | None = None):  # -> peft.PeftModel
    """Wrap ``model`` with PEFT LoRA adapters (base weights frozen); ``tinypipe.Engine`` trains
    the returned PeftModel's adapters. Targets must name linear layers of the decoder blocks."""
    from tinypipe.quant.spec import import_quietly

    import_quietly()  # before peft imports bitsandbytes itself (and logs a CPU-kernel warning)
    import peft

    from tinypipe.lora.hooks import is_peft_model

    settings = settings or LoraSettings()
    if is_peft_model(model):
        raise ConfigError("the model already has PEFT adapters; pass it to tinypipe.Engine directly")
    if settings.quantize is not None:  # QLoRA: bitsandbytes modules first, PEFT wraps those
        from tinypipe.quant.model import quantize_model

        quantize_model(model, settings.quant_spec)
    linears = block_linears(model)
    if not linears:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no linear layers inside the decoder blocks to adapt")
    targets = list(settings.targets) if settings.targets is not None else list(linears)
    unknown = [t for t in targets if t not in linears]
    if unknown:
        raise ConfigError(
            f"lora_targets {', '.join(unknown)} match no linear layer in the decoder blocks "
            f"(available: {', '.join(linears)})"
        )
    inside = {full for t in targets for full in linears[t]}
    conv = _linear_types()[1:]
    fan_in_fan_out = bool(conv) and any(isinstance(model.get_submodule(f), conv) for f in inside)
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
        fan_in_fan_out=fan_in_fan_out,
    )
    with warnings.catch_warnings():
        # peft reads transformers' deprecated ``is_gradient_checkpointing`` alias: a FutureWarning
        # on every wrap (every plan with --lora) that the user can do nothing about
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        wrapped = peft.get_peft_model(model, config)
    from peft.tuners.lora import LoraLayer

    outside = [n for n, m in wrapped.base_model.model.named_modules()
               if isinstance(m, LoraLayer) and n not in inside]
    if outside:
        raise ConfigError(f"lora_targets also match layers outside the decoder blocks "
                          f"({', '.join(outside[:3])}); name only block projections")
    return wrapped
