"""One planning request: everything the plan search takes, in one frozen value, validated once.

The engine (:func:`tinypipe.planner.auto.request_for`, from a :class:`~tinypipe.Config` and the
model), ``tinypipe plan`` (from its flags), the replica search and the keyword wrapper
:func:`~tinypipe.planner.search.plan_for` all build a :class:`PlanRequest` and hand it to
:func:`~tinypipe.planner.search.plan`. The search body reads only the request, so what a plan was
chosen for is one object (printable, comparable, replaceable for a re-plan at another batch), and
each refusal of a bad input is written here, once, instead of at the top of every entry.

The adapters come as the loader handed them down (``lora``: a
:class:`~tinypipe.lora.settings.LoraSettings` sized against the model, QLoRA's quantization
included): the request never re-derives them, and a model whose adapters cannot be read is refused
by the reader (:func:`~tinypipe.planner.auto.lora_settings_of`) -- never planned as full fine-tuning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import transformers

from tinypipe.config import PRECISIONS, Precision
from tinypipe.errors import ConfigError
from tinypipe.planner.presets import load_model_config
from tinypipe.planner.ssd import SsdSpec, sharded_ssd_refusal
from tinypipe.schedule.plan import DeviceOptimizer

if TYPE_CHECKING:
    from tinypipe.lora.settings import LoraSettings


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What to plan for. Built once per search; ``__post_init__`` refuses what no search can plan
    (one line each) and resolves a preset name to its model config."""

    # -- workload ---------------------------------------------------------------------------------
    #: The model: its HF config, or a preset name / config path (resolved here, once).
    model_config: transformers.PretrainedConfig | str
    #: Tokens per sequence (>= 2: a next-token loss needs two).
    seq: int
    #: Sequences per optimizer step, over all micro-batches (>= 1).
    global_batch: int

    # -- budgets ----------------------------------------------------------------------------------
    #: Pipeline devices of one replica (>= 1).
    gpus: int
    #: Host memory the plan must fit, bytes (> 0); one replica's share when ``host_shards`` > 1.
    cpu_memory_bytes: int
    #: Memory per device, bytes (> 0); None: the hardware's (known only once the hardware is loaded).
    gpu_memory_bytes: int | None = None
    #: The plan is one rank of this many data-parallel replicas sharding the host AdamW state
    #: (``optimizer_sharding="shard"``); 1: not sharded.
    host_shards: int = 1

    # -- precision and clipping -------------------------------------------------------------------
    #: Compute precision of the blocks (the masters and moments are fp32 either way).
    precision: Precision = "bf16"
    #: Gradient clipping norm (> 0); set, plans are ranked by the step where clipping triggers.
    max_grad_norm: float | None = None

    # -- adapters ---------------------------------------------------------------------------------
    #: The LoRA (QLoRA: ``quantize`` set) adapters as the loader handed them down; None: full FT.
    lora: LoraSettings | None = None

    # -- SSD --------------------------------------------------------------------------------------
    #: The SSD tier (offload directory and rates): host memory becomes a hard limit with the SSD
    #: as the overflow; None: DRAM only.
    ssd: SsdSpec | None = None
    #: With state on the SSD, search the global batch that hides its I/O (False: skip those re-plans).
    hiding_search: bool = True

    # -- search knobs (None: searched) ------------------------------------------------------------
    #: Which resident layers keep their AdamW on the device; None: searched.
    device_optimizer: DeviceOptimizer | None = None
    #: Packs held on the GPU for the whole step; None: searched.
    resident_packs: int | None = None
    #: Keep activations instead of recomputing: True every keepable pack, False none, None searched.
    keep_activations: bool | None = None
    #: Micro-batch-wise turn packs: 0 none, None searched (a count needs a hand-set packing).
    turn_packs: int | None = None
    #: Under clipping, let each plan's GPU step the clipped updates it can (never for shards).
    assist_updates: bool = True
    #: Tokens per MLP chunk (0: unchunked; None: the engine's automatic choice for ``seq``).
    mlp_chunk_tokens: int | None = None
    #: Documents packed into each sequence: their token-weighted mean length (sum of squared
    #: lengths / sum of lengths), which sets attention's FLOPs (each attends within itself);
    #: None: one document per sequence.
    document_tokens: int | None = None
    #: Tokens per attention tile of a long segment (0: whole segments; None: the engine's
    #: default, :data:`~tinypipe.models.tiled_attention.ATTENTION_TILE_TOKENS`).
    attention_tile_tokens: int | None = None
    #: Host gradient buffers the runtime keeps (None: its default).
    host_grad_buffers: int | None = None
    #: Plans kept on the result's Pareto front.
    max_pareto: int = 8

    #: The model's name as printed (derived: the preset name, or the config's ``name_or_path``).
    model_name: str = field(init=False, default="")

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ConfigError(f"--gpus must be >= 1, got {self.gpus}")
        if self.seq < 2:
            raise ConfigError(f"sequence length must be >= 2, got {self.seq}")
        if self.global_batch < 1:
            raise ConfigError(f"global batch must be >= 1, got {self.global_batch}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.keep_activations is not None and not isinstance(self.keep_activations, bool):
            raise ConfigError("the planner chooses the packing: keep_activations must be true, false or "
                              "unset (a per-pack list needs a hand-set packing), got "
                              f"{self.keep_activations!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        if self.turn_packs not in (None, 0):
            raise ConfigError("the planner chooses the packing: turn_packs must be 0 (no turn) or unset "
                              f"(searched), got {self.turn_packs!r}")
        if self.cpu_memory_bytes <= 0:
            raise ConfigError("host memory budget must be positive")
        if self.gpu_memory_bytes is not None and self.gpu_memory_bytes <= 0:
            raise ConfigError(f"GPU memory budget must be positive, got {self.gpu_memory_bytes}")
        if self.host_shards < 1:
            raise ConfigError(f"host_shards must be >= 1, got {self.host_shards}")
        if self.document_tokens is not None and self.document_tokens < 1:
            raise ConfigError(f"document_tokens must be >= 1, got {self.document_tokens}")
        if self.attention_tile_tokens is not None and self.attention_tile_tokens < 0:
            raise ConfigError(f"attention_tile_tokens must be >= 0, got {self.attention_tile_tokens}")
        if self.host_shards > 1 and self.ssd is not None:
            raise sharded_ssd_refusal()
        cfg, name = _resolve(self.model_config)
        object.__setattr__(self, "model_config", cfg)  # frozen: set once, here
        object.__setattr__(self, "model_name", name)
        max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        if isinstance(max_pos, int) and self.seq > max_pos:
            raise ConfigError(f"sequence length {self.seq} exceeds the model's max_position_embeddings "
                              f"{max_pos} (--extend-context scales its RoPE to reach it)")

    @property
    def config(self) -> transformers.PretrainedConfig:
        """The resolved model config (``model_config`` after ``__post_init__``)."""
        assert isinstance(self.model_config, transformers.PretrainedConfig)
        return self.model_config

    @property
    def clipping(self) -> bool:
        """Whether clipping is on: plans are ranked by the clipped step and retain gradients."""
        return self.max_grad_norm is not None


def _resolve(config: transformers.PretrainedConfig | str) -> tuple[transformers.PretrainedConfig, str]:
    """The model config and the name it is printed under."""
    if isinstance(config, transformers.PretrainedConfig):
        return config, getattr(config, "name_or_path", "") or getattr(config, "model_type", "")
    return load_model_config(str(config)), str(config)
