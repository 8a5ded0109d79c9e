"""``finetune`` settings: the option table, value parsers, config files (TOML/YAML) and their resolution.

Each :class:`Option` is both a ``--flag`` and a config-file key (underscores); flags override the
file, the file overrides the defaults. Also the checks shared by the commands (positive values,
devices). No torch import at module level.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tinypipe.config import DEVICE_OPTIMIZER_CHOICES, OPTIMIZER_SHARDING_CHOICES, PRECISIONS
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
    """One ``finetune`` setting: a ``--flag`` and the same key (underscores) in a config file.

    ``field`` is the setting's own name (the :class:`tinypipe.Config` / :class:`~tinypipe.schedule.plan.Plan`
    field) where the friendlier flag differs from it: this table is the one place flags map to
    names. The resolved settings and argparse use that name (:attr:`dest`)."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    flag: bool = False  # a store_true switch
    field: str | None = None

    @property
    def key(self) -> str:
        """The config-file key: the flag's name with underscores."""
        return self.name.replace("-", "_")

    @property
    def dest(self) -> str:
        """The setting's name: its Config / Plan field, else :attr:`key`."""
        return self.field or self.key


FINETUNE_OPTIONS: tuple[Option, ...] = (
    Option("model", _str, None, "Hugging Face model directory (config.json + safetensors) or a .gguf file",
           "PATH"),
    Option("data", _str, None, "training data: .jsonl (text, prompt/completion or chat messages) or .txt",
           "FILE"),
    Option("output", _str, None, "directory for the fine-tuned model, tokenizer, metrics.jsonl, loss.png "
           "and timeline.png", "DIR"),
    Option("seq-len", _int, None, "tokens per training row (default: min(1024, the model's max positions))",
           "N"),
    Option("global-batch", _int, 8, "rows per optimizer step (default: 8)", "N"),
    Option("micro-batch", _int, None, "rows per micro-batch on a device; bigger is faster and needs more "
           "device memory (default: the planner's choice on CUDA, 1 on cpu)", "N", field="micro_batch_size"),
    Option("pack-size", _pack_size, None, "decoder blocks per pack, or a list like 4,4,2 (default: the "
           "planner's choice on CUDA, 1 on cpu)", "N"),
    Option("gpu-memory", _size, None, "memory budget per GPU, e.g. 24GiB: the plan must fit it and the "
           "process is capped to it (default: the GPU's)", "SIZE", field="gpu_memory_bytes"),
    Option("cpu-memory", _size, None, "host memory budget, e.g. 100GiB: the plan must fit it (default: the "
           "available RAM)", "SIZE", field="cpu_memory_bytes"),
    Option("offload-dir", _str, None, "a directory on a fast local SSD for training state that does not fit "
           "in host memory (the plan says what goes there; scratch files removed at exit; default: "
           "everything in DRAM)", "DIR", field="offload_dir"),
    Option("steps", _int, None, "optimizer steps (default: as many as --epochs takes)", "N"),
    Option("epochs", _float, None, "passes over the data when --steps is not given (default: 1)", "X"),
    Option("lr", _float, 1e-5, "peak learning rate (default: 1e-5)", "LR"),
    Option("warmup-steps", _int, 0, "linear warm-up steps (default: 0)", "N"),
    Option("schedule", _str, "cosine", "learning-rate decay after warm-up (default: cosine)",
           None, SCHEDULES),
    Option("min-lr-ratio", _float, 0.1, "final learning rate as a fraction of --lr (default: 0.1)", "X"),
    Option("weight-decay", _float, 0.0, "AdamW weight decay, not applied to biases and normalization "
           "weights, as in HF Trainer (default: 0)", "X"),
    Option("decay-all", _bool, False, "apply --weight-decay to every parameter, biases and norm weights "
           "included", flag=True),
    Option("device-optimizer", _str, None, "keep the embedding's / head's AdamW state on the GPU and step "
           "it there: 12 bytes/parameter of GPU memory, less link traffic and no host AdamW tail (default: "
           "the planner's choice on CUDA, off on cpu)", None, DEVICE_OPTIMIZER_CHOICES),
    Option("resident-packs", _int, None, "keep the first N packs on the GPU for the whole run, stepped "
           "there: 18 bytes/parameter of GPU memory (bf16), no swapping or host AdamW for them (default: "
           "the planner's choice on CUDA, 0 on cpu)", "N"),
    Option("keep-activations", _bool, None, "on: keep the autograd activations of every pack on the GPU "
           "(over a QLoRA base: the resident packs and the last pack), so none is recomputed: their whole "
           "step's activations in GPU memory; off: recompute every pack (default: the planner's choice "
           "on CUDA, off on cpu)", "on|off"),
    Option("turn-packs", _int, None, "run the last N packs micro-batch-wise at the forward->backward turn: "
           "each micro-batch goes forward through them, through the head and back while their weights stay "
           "on the GPU, so they recompute nothing and hold one micro-batch's activations each (default: the "
           "planner's choice on CUDA, 0 on cpu)", "N"),
    Option("mlp-chunk-tokens", _int, None, "run each decoder block's MLP over at most N tokens at a time, so "
           "its intermediates stay bounded at long sequences (a longer micro-batch recomputes each chunk in "
           "its backward); 0: never (default: automatic -- off up to 16384 tokens per row, above that a "
           "chunk whose one intermediate is ~256 MiB)", "N"),
    Option("no-assist", _bool, False, "never let the GPU take host AdamW updates (default: the planner may "
           "step some layers' updates on the GPU, their fp32 state making a round trip over the link)",
           flag=True),
    Option("optimizer-sharding", _str, "auto", "with data-parallel replicas (torchrun): each replica keeps "
           "the whole host AdamW state (replicate) or only its 1/R shard (shard: less host memory, one "
           "all-gather of the updated weights per layer) (default: auto, the planner's choice)", None,
           OPTIMIZER_SHARDING_CHOICES),
    Option("max-grad-norm", _optional_float, None, "clip the global gradient norm to this (default: off; "
           "costs one fp32 gradient copy in host memory)", "X"),
    Option("seed", _int, 0, "seed for the data order and the dropout masks (default: 0)", "N"),
    Option("packing", _str, "on", "on: whole examples share rows, each attending only within itself (an "
           "example is split only when longer than --seq-len); off: one example per row, padded "
           "(default: on)", None, ("on", "off")),
    Option("no-dropout", _bool, False, "train without the model's dropout (modules in eval mode; default: "
           "the model's own dropout, as Hugging Face's Trainer)", flag=True),
    Option("devices", _devices, None, "comma-separated devices, e.g. cuda:0,cuda:1 (default: cuda:0 if "
           "available, else cpu)", "LIST"),
    Option("precision", _str, None, "compute precision; master weights stay fp32 (default: bf16 on CUDA, "
           "fp32 on cpu)", None, PRECISIONS),
    Option("skip-bad-lines", _bool, False, "skip malformed data lines (logged) instead of stopping",
           flag=True),
    Option("plan", _str, None, "a plan from `tinypipe plan --save-plan FILE` (packs, micro-batches, "
           "placement; overrides those flags)", "FILE"),
    Option("checkpoint-every", _int, None, "write an atomic checkpoint to OUTPUT/checkpoint every N steps, "
           "N >= 1 (default: off)", "N"),
    Option("resume", _bool, False, "continue from OUTPUT/checkpoint (same data and settings): the result "
           "equals an uninterrupted run", flag=True),
    Option("overwrite", _bool, False, "start a new run over OUTPUT's checkpoint and saved model (without "
           "it, a fresh run into an OUTPUT holding them is refused)", flag=True),
    Option("force", _bool, False, "with --resume: continue even though the checkpoint was made with other "
           "settings (they are listed)", flag=True),
    Option("eval-data", _str, None, "held-out data (same formats as --data) to evaluate the loss on", "FILE"),
    Option("eval-split", _float, None, "hold out this fraction of the training rows (seeded) to evaluate "
           "on, e.g. 0.02", "X"),
    Option("eval-every", _int, 0, "evaluate the held-out loss every N steps (default: after the last "
           "step only)", "N"),
    Option("report-to", _str, None, "also log the metrics to TensorBoard (OUTPUT/runs)", None,
           ("none", "tensorboard")),
    Option("lora", _bool, False, "train LoRA adapters only (base weights frozen, kept at the compute "
           "precision); OUTPUT gets a PEFT adapter", flag=True),
    Option("lora-rank", _int, None, "LoRA rank r (default: 8)", "R"),
    Option("lora-alpha", _float, None, "LoRA alpha; updates are scaled by alpha/rank (default: 16)", "X"),
    Option("lora-dropout", _float, None, "LoRA dropout, applied while training (PEFT's lora_dropout; "
           "off with --no-dropout) and written to adapter_config.json (default: 0)", "P"),
    Option("lora-targets", _names, None, "comma-separated linear layers in the decoder blocks to adapt, "
           "e.g. q_proj,v_proj (default: every attention and MLP projection)", "LIST"),
    Option("merge", _bool, False, "with --lora: also write the merged full model to OUTPUT/merged",
           flag=True),
    Option("quantize", _str, None, "with --lora: QLoRA -- quantize the frozen base's block linears with "
           "bitsandbytes while loading (nf4/fp4: ~0.53 byte/param with double quantization, int8: ~1)",
           "nf4|fp4|int8"),
)
_OPTIONS_BY_DEST = {o.dest: o for o in FINETUNE_OPTIONS}
_OPTIONS_BY_KEY = {o.key: o for o in FINETUNE_OPTIONS}


def _load_config_file(path: str) -> dict[str, Any]:
    """Settings from a TOML or YAML file, keys as the flag names with underscores."""
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
        out[option.dest] = parsed
    return out


def _resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults, overridden by the config file, overridden by flags given on the command line."""
    settings = {o.dest: o.default for o in FINETUNE_OPTIONS}
    if args.config:
        settings.update(_load_config_file(args.config))
    for o in FINETUNE_OPTIONS:
        value = getattr(args, o.dest, None)
        if value is not None:
            settings[o.dest] = value
    for required in ("model", "data", "output"):
        if not settings.get(required):
            raise ConfigError(f"--{required} is required (on the command line or in the config file)")
    return settings


def _positive(name: str, value: int | float | None, minimum: float = 1) -> None:
    if value is not None and not value >= minimum:
        raise ConfigError(f"{name} must be >= {minimum:g}, got {value}")


def _default_device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _check_devices(devices: Sequence[str]) -> None:
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
