"""What the commands print and write: the output directory, one-line messages, loss summaries, saved files."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from tinypipe.errors import ConfigError

PROG = "tinypipe"
EXIT_USAGE = 2


def prepare_output(path: str) -> Path:
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
        from tinypipe.write_errors import describe as describe_os_error

        raise ConfigError(f"--output {out}: not writable ({describe_os_error(exc)})") from None
    return out


def loss_summary(records: list[dict]) -> str:
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


def eval_summary(records: list[dict]) -> str | None:
    """The last held-out evaluation of the run, or None when it had none."""
    held = [r for r in records if "eval_loss" in r]
    if not held:
        return None
    last = held[-1]
    trend = f" (first, after step {held[0]['step']}: {held[0]['eval_loss']:.4f})" if len(held) > 1 else ""
    return (f"held-out: loss {last['eval_loss']:.4f}, perplexity {last['eval_perplexity']:.2f} over "
            f"{last['eval_tokens']} tokens after step {last['step']}{trend}")


def save_outputs(engine: Any, tokenizer: Any, records: list[dict], out: Path) -> tuple[Path, Path]:
    """The model (or adapter), tokenizer and plots: ``loss.png`` and ``timeline.png`` (memory and
    link traffic per step, the last step's lanes)."""
    from tinypipe.train.plots import plot_metrics, plot_timeline

    from tinypipe.errors import WriteError
    from tinypipe.write_errors import describe, os_errors

    engine.save_pretrained(out)
    try:
        with os_errors():
            tokenizer.save_pretrained(str(out))
            png = plot_metrics(records, out / "loss.png")
            plot_timeline(records, engine.step_timeline(), out / "timeline.png")
    except OSError as exc:
        raise WriteError(f"cannot save to {out}: {describe(exc)}") from exc
    return out / "metrics.jsonl", png


def format_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def process_seconds() -> float | None:
    """Wall seconds since this process started (imports included), if the OS says."""
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - only a nicety
        return None


def say(*parts: object) -> None:
    if os.environ.get("RANK", "0") != "0":  # torchrun: only rank 0 reports (errors go to every stderr)
        return
    print(*parts, flush=True)


def error_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{PROG}: error: {text}"
