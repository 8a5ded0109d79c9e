"""``finetune`` settings: the option table, value parsers, config files (TOML/YAML), their resolution
into typed settings, and the engine's Config built from them.

:class:`FinetuneSettings` is the option table: each field is an :class:`Option` -- a ``--flag``, the
same key (underscores) in a config file and the settings' attribute -- that names the
:class:`tinypipe.Config` field it sets, or none (the command's own settings). Flags override the
file, the file overrides the defaults (:func:`resolve_settings`); :func:`engine_config` builds the
Config from the table, no field mapped by hand. Also the checks shared by the commands (lower
bounds, devices). No torch import at module level.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import operator
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tinypipe.config import DEVICE_OPTIMIZER_CHOICES, OPTIMIZER_SHARDING_CHOICES, PRECISIONS, Config
from tinypipe.errors import ConfigError
from tinypipe.train.loop import SCHEDULES
from tinypipe.units import parse_bytes


def _int(text: Any) -> int:
    if isinstance(text, bool):
        raise ValueError("expected an integer")
    if isinstance(text, int):
        return text
    if isinstance(text, float):
        if text.is_integer():
            return int(text)
        raise ValueError("expected an integer")
    try:
        return int(str(text).strip())
    except ValueError:
        raise ValueError("expected an integer") from None


def _float(text: Any) -> float:
    if isinstance(text, bool):
        raise ValueError("expected a number")
    try:
        value = float(text) if isinstance(text, (int, float)) else float(str(text).strip())
    except ValueError:
        raise ValueError("expected a number") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value}")
    return value


def _optional_float(text: Any) -> float | None:
    if text is None or (isinstance(text, str) and text.strip().lower() in ("none", "off", "")):
        return None
    return _float(text)


def _str(text: Any) -> str:
    if not isinstance(text, (str, os.PathLike)):
        raise ValueError("expected a string")
    return str(text)


def _devices(value: Any) -> list[str]:
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    out = [str(d).strip() for d in items if str(d).strip()]
    if not out:
        raise ValueError("expected device names such as cuda:0,cuda:1 or cpu")
    return out


def _pack_size(value: Any) -> int | list[int]:
    if isinstance(value, (list, tuple)):
        return [_int(v) for v in value]
    text = str(value).strip()
    if "," in text:
        return [_int(v) for v in text.split(",") if v.strip()]
    return _int(text)


def _names(value: Any) -> list[str]:
    items = value if isinstance(value, (list, tuple)) else _str(value).split(",")
    out = [str(v).strip() for v in items if str(v).strip()]
    if not out:
        raise ValueError("expected module names such as q_proj,v_proj")
    return out


def _size(value: Any) -> int:
    try:
        return parse_bytes(value if isinstance(value, (int, float)) else _str(value))
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


@dataclass(frozen=True)
class Option:
    """One ``finetune`` setting: a ``--flag``, the same key (underscores) in a config file, and the
    :class:`FinetuneSettings` attribute of that name -- one name in all three.

    ``config`` is the :class:`tinypipe.Config` field the option sets (None: the command's own
    setting -- data, output, schedule, checkpoints, LoRA); ``to_config`` converts the option's value
    to the field's (None: as it is). ``workload`` options (the row length and the global batch)
    reach the Config only after the model is loaded -- the row length is resolved against its
    positions -- and only when the engine plans or checks its budgets (:func:`config_values`)."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    flag: bool = False  # a store_true switch
    config: str | None = None
    to_config: Callable[[Any], Any] | None = None
    workload: bool = False

    @property
    def key(self) -> str:
        """The config-file key and the settings' attribute: the flag's name with underscores."""
        return self.name.replace("-", "_")


_OPTION = "tinypipe.cli.option"  # the metadata key of FinetuneSettings' fields
REQUIRED: Any = dataclasses.MISSING  # an option without a default (--model, --data, --output)


def option(parse: Callable[[Any], Any], default: Any, help: str, metavar: str | None = None,
           choices: tuple[str, ...] | None = None, *, flag: bool = False, config: str | None = None,
           to_config: Callable[[Any], Any] | None = None, workload: bool = False) -> Any:
    """A :class:`FinetuneSettings` field that is also an :class:`Option` (named after the field)."""
    spec = {"parse": parse, "help": help, "metavar": metavar, "choices": choices, "flag": flag,
            "config": config, "to_config": to_config, "workload": workload}
    return dataclasses.field(default=default, metadata={_OPTION: spec})


def offload_dirs(value: str | None) -> str | tuple[str, ...] | None:
    """``--offload-dir A`` or ``A,B`` (one directory per drive: the state is striped over them)."""
    if not value:
        return None
    from tinypipe.storage.stripe import parse_directories

    return parse_directories(value)


@dataclass(frozen=True)
class FinetuneSettings:
    """The ``finetune`` settings, resolved: defaults, overridden by ``--config FILE``, overridden by
    the flags (:func:`resolve_settings`); checked when made (one-line ConfigError).

    This class is the option table: each field is one :class:`Option` (:data:`FINETUNE_OPTIONS`),
    in the order ``--help`` lists them; ``config=`` names the :class:`tinypipe.Config` field it
    sets, and :func:`engine_config` builds the Config from those names alone."""

    model: str = option(_str, REQUIRED, "Hugging Face model directory (config.json + safetensors) or a "
                        ".gguf file", "PATH")
    data: str = option(_str, REQUIRED, "training data: .jsonl (text, prompt/completion or chat messages) "
                       "or .txt", "FILE")
    output: str = option(_str, REQUIRED, "directory for the fine-tuned model, tokenizer, metrics.jsonl, "
                         "loss.png and timeline.png", "DIR")
    seq_len: int | None = option(_int, None, "tokens per training row (default: min(1024, the model's max "
                                 "positions))", "N", config="seq_len", workload=True)
    extend_context: bool = option(_bool, False, "a --seq-len beyond the model's max positions: scale its "
                                  "RoPE to reach it (YaRN for plain RoPE, a larger factor for llama3/yarn/"
                                  "linear scaling); the saved config carries it", flag=True)
    global_batch: int = option(_int, 8, "rows per optimizer step (default: 8)", "N", config="global_batch",
                               workload=True)
    micro_batch: int | None = option(_int, None, "rows per micro-batch on a device; bigger is faster and "
                                     "needs more device memory (default: the planner's choice on CUDA, 1 on "
                                     "cpu)", "N", config="micro_batch_size")
    pack_size: int | list[int] | None = option(_pack_size, None, "decoder blocks per pack, or a list like "
                                               "4,4,2 (default: the planner's choice on CUDA, 1 on cpu)", "N",
                                               config="pack_size")
    gpu_memory: int | None = option(_size, None, "memory budget per GPU, e.g. 24GiB: the plan must fit it "
                                    "and the process is capped to it (default: the GPU's)", "SIZE",
                                    config="gpu_memory_bytes")
    cpu_memory: int | None = option(_size, None, "host memory budget, e.g. 100GiB: the plan must fit it "
                                    "(default: the available RAM)", "SIZE", config="cpu_memory_bytes")
    offload_dir: str | None = option(_str, None, "a directory on a fast local SSD for training state that "
                                     "does not fit in host memory (the plan says what goes there; scratch "
                                     "files removed at exit; default: everything in DRAM)", "DIR",
                                     config="offload_dir", to_config=offload_dirs)
    steps: int | None = option(_int, None, "optimizer steps (default: as many as --epochs takes)", "N")
    epochs: float | None = option(_float, None, "passes over the data when --steps is not given (default: "
                                  "1)", "X")
    lr: float = option(_float, 1e-5, "peak learning rate (default: 1e-5)", "LR", config="lr")
    warmup_steps: int = option(_int, 0, "linear warm-up steps (default: 0)", "N")
    schedule: str = option(_str, "cosine", "learning-rate decay after warm-up (default: cosine)", None,
                           SCHEDULES)
    min_lr_ratio: float = option(_float, 0.1, "final learning rate as a fraction of --lr (default: 0.1)",
                                 "X")
    weight_decay: float = option(_float, 0.0, "AdamW weight decay, not applied to biases and normalization "
                                 "weights, as in HF Trainer (default: 0)", "X", config="weight_decay")
    decay_all: bool = option(_bool, False, "apply --weight-decay to every parameter, biases and norm "
                             "weights included", flag=True, config="decay_all")
    device_optimizer: str | None = option(_str, None, "keep the embedding's / head's AdamW state on the GPU "
                                          "and step it there: 12 bytes/parameter of GPU memory, less link "
                                          "traffic and no host AdamW tail (default: the planner's choice on "
                                          "CUDA, off on cpu)", None, DEVICE_OPTIMIZER_CHOICES,
                                          config="device_optimizer")
    resident_packs: int | None = option(_int, None, "keep the first N packs on the GPU for the whole run, "
                                        "stepped there: 18 bytes/parameter of GPU memory (bf16), no swapping "
                                        "or host AdamW for them (default: the planner's choice on CUDA, 0 on "
                                        "cpu)", "N", config="resident_packs")
    keep_activations: bool | None = option(_bool, None, "on: keep the autograd activations of every pack on "
                                           "the GPU (over a QLoRA base: the resident packs and the last "
                                           "pack), so none is recomputed: their whole step's activations in "
                                           "GPU memory; off: recompute every pack (default: the planner's "
                                           "choice on CUDA, off on cpu)", "on|off", config="keep_activations")
    turn_packs: int | None = option(_int, None, "run the last N packs micro-batch-wise at the "
                                    "forward->backward turn: each micro-batch goes forward through them, "
                                    "through the head and back while their weights stay on the GPU, so they "
                                    "recompute nothing and hold one micro-batch's activations each (default: "
                                    "the planner's choice on CUDA, 0 on cpu)", "N", config="turn_packs")
    mlp_chunk_tokens: int | None = option(_int, None, "run each decoder block's MLP over at most N tokens at "
                                          "a time, so its intermediates stay bounded at long sequences (a "
                                          "longer micro-batch recomputes each chunk in its backward); 0: "
                                          "never (default: automatic -- off up to 16384 tokens per row, "
                                          "above that a chunk whose one intermediate is ~256 MiB)", "N",
                                          config="mlp_chunk_tokens")
    attention_tile_tokens: int | None = option(_int, None, "a document longer than N tokens attends in tiles "
                                               "of N x N through the fused kernel, so its backward holds one "
                                               "tile's temporaries, not the whole document's; 0: whole "
                                               "documents (default: the planner's choice of 8192, 16384 or "
                                               "32768, where long documents attend per segment)", "N",
                                               config="attention_tile_tokens")
    no_assist: bool = option(_bool, False, "never let the GPU take host AdamW updates (default: the planner "
                             "may step some layers' updates on the GPU, their fp32 state making a round trip "
                             "over the link)", flag=True, config="assist_updates", to_config=operator.not_)
    optimizer_sharding: str = option(_str, "auto", "with data-parallel replicas (torchrun): each replica "
                                     "keeps the whole host AdamW state (replicate) or only its 1/R shard "
                                     "(shard: less host memory, one all-gather of the updated weights per "
                                     "layer) (default: auto, the planner's choice)", None,
                                     OPTIMIZER_SHARDING_CHOICES, config="optimizer_sharding")
    max_grad_norm: float | None = option(_optional_float, None, "clip the global gradient norm to this "
                                         "(default: off; costs one fp32 gradient copy in host memory)", "X",
                                         config="max_grad_norm")
    seed: int = option(_int, 0, "seed for the data order and the dropout masks (default: 0)", "N",
                       config="dropout_seed")
    packing: str = option(_str, "on", "on: whole examples share rows, each attending only within itself (an "
                          "example is split only when longer than --seq-len); off: one example per row, "
                          "padded (default: on)", None, ("on", "off"))
    no_dropout: bool = option(_bool, False, "train without the model's dropout (modules in eval mode; "
                              "default: the model's own dropout, as Hugging Face's Trainer)", flag=True,
                              config="dropout", to_config=operator.not_)
    devices: list[str] | None = option(_devices, None, "comma-separated devices, e.g. cuda:0,cuda:1 "
                                       "(default: cuda:0 if available, else cpu)", "LIST", config="devices")
    precision: str | None = option(_str, None, "compute precision; master weights stay fp32 (default: bf16 "
                                   "on CUDA, fp32 on cpu)", None, PRECISIONS, config="precision")
    skip_bad_lines: bool = option(_bool, False, "skip malformed data lines (logged) instead of stopping",
                                  flag=True)
    plan: str | None = option(_str, None, "a plan from `tinypipe plan --save-plan FILE` (packs, "
                              "micro-batches, placement; overrides those flags)", "FILE")
    checkpoint_every: int | None = option(_int, None, "write an atomic checkpoint to OUTPUT/checkpoint every "
                                          "N steps, N >= 1 (default: off)", "N")
    resume: bool = option(_bool, False, "continue from OUTPUT/checkpoint (same data and settings): the "
                          "result equals an uninterrupted run", flag=True)
    overwrite: bool = option(_bool, False, "start a new run over OUTPUT's checkpoint and saved model "
                             "(without it, a fresh run into an OUTPUT holding them is refused)", flag=True)
    force: bool = option(_bool, False, "with --resume: continue even though the checkpoint was made with "
                         "other settings (they are listed)", flag=True)
    eval_data: str | None = option(_str, None, "held-out data (same formats as --data) to evaluate the loss "
                                   "on", "FILE")
    eval_split: float | None = option(_float, None, "hold out this fraction of the training rows (seeded) to "
                                      "evaluate on, e.g. 0.02", "X")
    eval_every: int = option(_int, 0, "evaluate the held-out loss every N steps (default: after the last "
                             "step only)", "N")
    report_to: str | None = option(_str, None, "also log the metrics to TensorBoard (OUTPUT/runs)", None,
                                   ("none", "tensorboard"))
    lora: bool = option(_bool, False, "train LoRA adapters only (base weights frozen, kept at the compute "
                        "precision); OUTPUT gets a PEFT adapter", flag=True)
    lora_rank: int | None = option(_int, None, "LoRA rank r (default: 8)", "R")
    lora_alpha: float | None = option(_float, None, "LoRA alpha; updates are scaled by alpha/rank (default: "
                                      "16)", "X")
    lora_dropout: float | None = option(_float, None, "LoRA dropout, applied while training (PEFT's "
                                        "lora_dropout; off with --no-dropout) and written to "
                                        "adapter_config.json (default: 0)", "P")
    lora_targets: list[str] | None = option(_names, None, "comma-separated linear layers in the decoder "
                                            "blocks to adapt, e.g. q_proj,v_proj (default: every attention "
                                            "and MLP projection)", "LIST")
    merge: bool = option(_bool, False, "with --lora: also write the merged full model to OUTPUT/merged",
                         flag=True)
    quantize: str | None = option(_str, None, "with --lora: QLoRA -- quantize the frozen base's block "
                                  "linears with bitsandbytes while loading (nf4/fp4: ~0.53 byte/param with "
                                  "double quantization, int8: ~1)", "nf4|fp4|int8")

    def __post_init__(self) -> None:
        check_settings(self)


#: The option table, read off :class:`FinetuneSettings`' fields (flag name: the field's, hyphenated).
FINETUNE_OPTIONS: tuple[Option, ...] = tuple(
    Option(name=f.name.replace("_", "-"), default=None if f.default is dataclasses.MISSING else f.default,
           **f.metadata[_OPTION])
    for f in dataclasses.fields(FinetuneSettings))
_OPTIONS_BY_KEY = {o.key: o for o in FINETUNE_OPTIONS}


def load_config_file(path: str) -> dict[str, Any]:
    """Settings from a TOML or YAML file, keys as the flag names with underscores (parsed, by key)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    suffix = p.suffix.lower()
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read ({exc.strerror or exc})") from None
    if suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ModuleNotFoundError:
                raise ConfigError(f"{p}: reading TOML on Python 3.10 needs `pip install tomli` "
                                  "(or use YAML)") from None
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{p}: invalid TOML ({' '.join(str(exc).split())})") from None
    elif suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(raw.decode("utf-8"))
        except (UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(f"{p}: invalid YAML ({' '.join(str(exc).split())[:200]})") from None
        if data is None:
            data = {}
    else:
        raise ConfigError(f"{p}: unsupported config file type {suffix or '(none)'!r}; use .toml or .yaml")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a table of settings (key = value), got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        option = _OPTIONS_BY_KEY.get(str(key).replace("-", "_"))
        if option is None:
            known = ", ".join(sorted(_OPTIONS_BY_KEY))
            raise ConfigError(f"{p}: unknown setting {key!r} (known: {known})")
        try:
            parsed = option.parse(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{p}: {option.key}: invalid value {value!r} ({exc})") from None
        if option.choices and parsed not in option.choices:
            raise ConfigError(f"{p}: {option.key}: invalid value {value!r} "
                              f"(choose from {', '.join(option.choices)})")
        out[option.key] = parsed
    return out


def resolve_settings(args: argparse.Namespace) -> FinetuneSettings:
    """Defaults, overridden by the config file, overridden by flags given on the command line."""
    values = {o.key: o.default for o in FINETUNE_OPTIONS}
    if args.config:
        values.update(load_config_file(args.config))
    for o in FINETUNE_OPTIONS:
        value = getattr(args, o.key, None)
        if value is not None:
            values[o.key] = value
    for required in ("model", "data", "output"):
        if not values.get(required):
            raise ConfigError(f"--{required} is required (on the command line or in the config file)")
    return FinetuneSettings(**values)


def check_settings(s: FinetuneSettings) -> None:
    """Values the option parsers accept but the run cannot use (one-line ConfigError)."""
    check_at_least("global_batch", s.global_batch)
    check_at_least("micro_batch", s.micro_batch)
    check_at_least("seq_len", s.seq_len, 2)
    if s.extend_context and s.seq_len is None:
        raise ConfigError("--extend-context needs --seq-len (the length to reach)")
    check_at_least("mlp_chunk_tokens", s.mlp_chunk_tokens, 0)
    check_at_least("attention_tile_tokens", s.attention_tile_tokens, 0)
    check_at_least("steps", s.steps)
    check_at_least("warmup_steps", s.warmup_steps, 0)
    if s.checkpoint_every is not None and s.checkpoint_every < 1:  # 0 or -1 would silently mean "never"
        raise ConfigError(f"checkpoint_every must be >= 1 (leave it out for no checkpoints), "
                          f"got {s.checkpoint_every}")
    if s.epochs is not None and not s.epochs > 0:
        raise ConfigError(f"epochs must be > 0, got {s.epochs}")
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        raise ConfigError(f"min_lr_ratio must be in [0, 1], got {s.min_lr_ratio}")
    check_at_least("eval_every", s.eval_every, 0)
    if s.eval_split is not None and not 0.0 < s.eval_split < 1.0:
        raise ConfigError(f"eval_split must be in (0, 1), got {s.eval_split}")
    if s.eval_split is not None and s.eval_data:
        raise ConfigError("give --eval-data or --eval-split, not both")
    if s.eval_every and s.eval_split is None and not s.eval_data:
        raise ConfigError("eval_every needs held-out data: --eval-data FILE or --eval-split X")
    if s.force and not s.resume:
        raise ConfigError("--force only applies to --resume")
    for o in FINETUNE_OPTIONS:
        value = getattr(s, o.key)
        if o.choices and value is not None and value not in o.choices:
            raise ConfigError(f"{o.key} must be one of {', '.join(o.choices)}, got {value!r}")


def config_values(s: FinetuneSettings, *, workload: bool = False, **resolved: Any) -> dict[str, Any]:
    """Config field -> value for every option that names a field, read off the table: the workload
    options with ``workload``, the others without; ``resolved`` (by option key) replaces a setting's
    value with the one the run resolved (the row length, once the model is known)."""
    out = {}
    for o in FINETUNE_OPTIONS:
        if o.config is None or o.workload != workload:
            continue
        value = resolved[o.key] if o.key in resolved else getattr(s, o.key)
        out[o.config] = value if o.to_config is None else o.to_config(value)
    return out


def engine_config(s: FinetuneSettings) -> tuple[Config, bool]:
    """The engine's Config from the settings (:func:`config_values`), and whether the engine plans
    for itself (CUDA, no packing flag, no --plan). Three defaults depend on the machine: no
    ``--devices``: cuda:0 if there is one, else cpu; no ``--precision``: bf16 on CUDA, fp32 on cpu;
    without the automatic plan unset packing flags take the hand-set 1."""
    values = config_values(s)
    values["devices"] = values["devices"] or [default_device()]
    cuda = any(d.startswith("cuda") for d in values["devices"])
    auto = cuda and values["micro_batch_size"] is None and values["pack_size"] is None and not s.plan
    if not auto:
        values["micro_batch_size"] = values["micro_batch_size"] or 1
        values["pack_size"] = values["pack_size"] or 1
    values["precision"] = values["precision"] or ("bf16" if cuda else "fp32")
    config = Config(**values)
    check_devices(config.devices)
    return config, auto


def check_at_least(name: str, value: int | float | None, minimum: float = 1) -> None:
    """ConfigError (one line) when ``value`` is given and below ``minimum``."""
    if value is not None and not value >= minimum:
        raise ConfigError(f"{name} must be >= {minimum:g}, got {value}")


def default_device() -> str:
    """cuda:0 when CUDA is available, else cpu."""
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def check_devices(devices: Sequence[str]) -> None:
    """Fail before the (slow) model load when a device does not exist."""
    from tinypipe.devices.backend import make_backend

    for d in devices:
        make_backend(d)


def read_plan_file(path: str, num_devices: int, devices_flag: str = "--devices lists") -> Any:
    """The plan in ``path``: what ``tinypipe plan --save-plan`` writes, or a benchmark result
    holding one under ``"plan"`` (``bench/run.py --json``); one-line errors for anything else or
    for a plan made for another number of devices (``devices_flag`` names where that number came from)."""
    import json

    from tinypipe.schedule.plan import Plan

    try:
        data = json.loads(Path(path).expanduser().read_text())
        if isinstance(data, dict) and "packs" not in data and isinstance(data.get("plan"), dict):
            data = data["plan"]
        plan = Plan.from_json(json.dumps(data))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{path}: not a tinypipe plan ({exc})") from None
    if plan.num_devices != num_devices:
        raise ConfigError(f"{path}: plan is for {plan.num_devices} device(s), {devices_flag} {num_devices}")
    return plan
