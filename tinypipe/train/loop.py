"""The fine-tuning loop: learning-rate schedule, progress bar, per-step metrics, loss plot.

``train`` drives an :class:`~tinypipe.Engine` over a :class:`~tinypipe.train.data.PackedDataset`
for a fixed number of optimizer steps (wrapping into further epochs as needed), writes one JSON
line per step and returns the same records.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, Protocol

import psutil

from tinypipe.errors import ConfigError, WorkerError, WriteError
from tinypipe.train.at_once import TERM_EXIT_CODE, on_signals
from tinypipe.train.plots import plot_metrics  # noqa: F401 - re-exported
from tinypipe.train.stall import check_progress

if TYPE_CHECKING:
    import torch

    from tinypipe.runtime.engine import Engine
    from tinypipe.train.data import PackedDataset

__all__ = ["SCHEDULES", "lr_at", "plot_metrics", "read_metrics", "train"]

class Reporter(Protocol):
    """Somewhere the records go besides metrics.jsonl (TensorBoard:
    :class:`~tinypipe.train.tensorboard.TensorBoardReporter`)."""

    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


Schedule = Literal["cosine", "linear", "constant"]
SCHEDULES: tuple[str, ...] = ("cosine", "linear", "constant")


def lr_at(
    step: int,
    *,
    lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    schedule: Schedule = "cosine",
    min_lr_ratio: float = 0.0,
) -> float:
    """Learning rate of the 0-based optimizer step ``step``.

    Warm-up rises linearly over ``warmup_steps`` steps to ``lr`` (step 0 already trains, at
    ``lr / (warmup_steps + 1)``); the decay then runs from ``lr`` towards ``lr * min_lr_ratio``,
    reaching it just after the last step (so no step is wasted at the floor).
    """
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return lr
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    floor = lr * min_lr_ratio
    if schedule == "linear":
        return floor + (lr - floor) * (1.0 - progress)
    if schedule == "cosine":
        return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


def _check(steps: int, global_batch: int, lr: float, warmup_steps: int, schedule: str,
           min_lr_ratio: float) -> None:
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    if global_batch < 1:
        raise ConfigError(f"global_batch must be >= 1, got {global_batch}")
    if not lr >= 0:
        raise ConfigError(f"lr must be >= 0, got {lr}")
    if warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ConfigError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")


def _batches(dataset: PackedDataset, global_batch: int, seed: int, start_step: int = 0
             ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Batches forever, epoch after epoch (each epoch its own shuffle), from global step ``start_step``."""
    per_epoch = dataset.num_batches(global_batch)
    epoch, start = divmod(start_step, per_epoch) if per_epoch else (0, 0)
    while True:
        for batch in dataset.batches(global_batch, seed, epoch, start_batch=start):
            yield epoch, batch
        epoch, start = epoch + 1, 0


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM stopped training after a completed step (and its checkpoint, if enabled)."""

    def __init__(self, step: int, checkpoint: Path | None) -> None:
        where = f"; checkpoint at {checkpoint}" if checkpoint is not None else ""
        super().__init__(f"interrupted after step {step}{where}")
        self.step = step
        self.checkpoint = checkpoint


@contextlib.contextmanager
def _stop_requests() -> Iterator[dict[str, bool]]:
    """SIGINT/SIGTERM request a clean stop after the current step; a second SIGINT stops at once.

    Interrupting inside a step would leave layers half updated; finishing the step and writing a
    checkpoint loses nothing. (A rank of a multi-rank run stops at once on SIGTERM instead:
    :func:`_term_at_once`.)
    """
    flag = {"stop": False}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def request(signum: int, frame: object) -> None:
        if flag["stop"] and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag["stop"] = True

    previous = {sig: signal.signal(sig, request) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _term_at_once(engine: Engine, checkpoint_dir: str | os.PathLike[str] | None,
                  where: dict[str, int]) -> contextlib.AbstractContextManager[None]:
    """SIGTERM ends a rank of a multi-rank run at once (:mod:`tinypipe.train.at_once`), in one line
    naming the step it was in (``where``) and the checkpoint left intact; a lone process finishes
    its step and checkpoints instead (:func:`_stop_requests`)."""
    replicas, guard = engine.replicas, getattr(engine, "exit_guard", None)
    if replicas is None or guard is None:
        return contextlib.nullcontext()
    guard.describe = lambda: _checkpoint_note(checkpoint_dir)

    def stop(signum: int) -> None:
        name = signal.Signals(signum).name
        guard.exit_now(f"tinypipe: rank {replicas.rank} got {name} in step {where['step']} (torchrun's "
                       "signal to every rank when one fails) and stops at once", TERM_EXIT_CODE)

    return on_signals((signal.SIGTERM,), stop)


def _checkpoint_note(checkpoint_dir: str | os.PathLike[str] | None) -> str:
    """``; the checkpoint of step N in DIR is intact ...`` (read from the directory as it is now)."""
    if checkpoint_dir is None:
        return ""
    from tinypipe.runtime.checkpoint import find_checkpoint, read_extra
    from tinypipe.runtime.checkpoint_sharded import sharded_extra

    try:
        extra = sharded_extra(checkpoint_dir)
        if extra is None and find_checkpoint(checkpoint_dir) is not None:
            extra = read_extra(checkpoint_dir)
    except (OSError, ConfigError):
        extra = None
    if not extra:
        return f"; no checkpoint in {checkpoint_dir} yet"
    return (f"; the checkpoint of step {extra.get('step', '?')} in {checkpoint_dir} is intact "
            "(the same command plus --resume continues from it)")


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n / 1024:.0f}KiB"


def train(
    engine: Engine,
    dataset: PackedDataset,
    *,
    steps: int,
    global_batch: int,
    lr: float,
    warmup_steps: int = 0,
    schedule: Schedule = "cosine",
    min_lr_ratio: float = 0.1,
    seed: int = 0,
    log_path: str | os.PathLike[str] | None = None,
    progress: bool = True,
    append: bool = False,
    start_step: int = 0,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 0,
    checkpoint_extra: dict | None = None,
    eval_dataset: PackedDataset | None = None,
    eval_every: int = 0,
    eval_batch: int | None = None,
    reporters: tuple[Reporter, ...] = (),
) -> list[dict]:
    """Run ``steps`` optimizer steps of ``global_batch`` rows each; return one record per step.

    Each record (also written as one JSON line to ``log_path``, flushed every step so a crashed
    run keeps its metrics) holds ``step`` (1-based), ``epoch``, ``loss``, ``lr``, ``grad_norm``,
    ``tokens``, ``seconds``, ``tokens_per_s``, ``rss_bytes`` (host resident memory after the
    step), ``h2d_gbs`` / ``d2h_gbs`` (host<->device traffic over the step's time; 0 on CPU),
    ``gpu_peak_allocated`` / ``gpu_peak_reserved`` (the fullest device's peaks in the step; 0 on
    CPU), ``clipped`` and ``skipped``, and with the SSD tier ``ssd_read_bytes`` / ``ssd_write_bytes``
    and ``ssd_read_gbs`` / ``ssd_write_gbs`` (GB/s while requests were in flight). ``log_path`` is
    truncated first unless ``append``.

    Resuming: ``start_step`` continues a run at that global step (data position and learning rate
    follow from it); with ``checkpoint_dir`` and ``checkpoint_every`` K, an atomic checkpoint is
    written every K steps and after the last one (``engine.load_checkpoint`` returns
    ``{"step": ...}`` plus ``checkpoint_extra``, e.g. the run's settings), so a resumed run
    reproduces the uninterrupted one.

    Evaluation: with ``eval_dataset``, the held-out loss over all of it (forward only,
    :meth:`~tinypipe.Engine.evaluate`, ``eval_batch`` rows at a time, default ``global_batch``)
    every ``eval_every`` steps and after the last one; that step's record gets ``eval_loss``,
    ``eval_perplexity``, ``eval_tokens`` and ``eval_seconds`` (not counted in ``seconds``).
    ``reporters`` get every record too (TensorBoard).
    """
    _check(steps, global_batch, lr, warmup_steps, schedule, min_lr_ratio)
    if eval_every < 0:
        raise ConfigError(f"eval_every must be >= 0, got {eval_every}")
    _check_vocabulary(engine, dataset)
    vocab = getattr(getattr(getattr(engine, "model", None), "config", None), "vocab_size", None)
    batches = _batches(dataset, global_batch, seed, start_step)
    # data-parallel replicas: every rank trains (its rows of the same global batches); rank 0 logs
    replicas = engine.replicas
    main = replicas is None or replicas.is_main
    log = _open_log(Path(log_path), append) if log_path is not None and main else None
    bar = _progress_bar(steps, start_step) if progress and main else None
    proc = psutil.Process()
    records: list[dict] = []
    last_eval: float | None = None  # the latest held-out loss, kept on the progress line
    where = {"step": start_step + 1}  # the step under way, for a line on SIGTERM
    try:
        with _stop_requests() as stop, _term_at_once(engine, checkpoint_dir, where):
            for i in range(start_step, steps):
                where["step"] = i + 1
                epoch, batch = next(batches)
                step_lr = lr_at(i, lr=lr, total_steps=steps, warmup_steps=warmup_steps,
                                schedule=schedule, min_lr_ratio=min_lr_ratio)
                record = _run_step(engine, batch, step_lr, i, epoch, proc)
                due_eval = i + 1 == steps or (eval_every > 0 and (i + 1) % eval_every == 0)
                if eval_dataset is not None and due_eval:
                    from tinypipe.train.evaluation import evaluate_dataset  # torch: not at import

                    record.update(evaluate_dataset(engine, eval_dataset, eval_batch or global_batch))
                    last_eval = record["eval_loss"]
                records.append(record)
                for reporter in reporters:
                    reporter.write(record)
                if log is not None:
                    _write_record(log, record, i)
                if bar is not None:
                    _show_progress(bar, record, last_eval)
                check_progress(record, vocab, lr)  # a wrecked model: stop before its checkpoint
                due = checkpoint_every > 0 and ((i + 1) % checkpoint_every == 0 or i + 1 == steps)
                if replicas is not None:  # one stop decision for every rank (the checkpoint is collective)
                    stop["stop"] = _any_rank(replicas, stop["stop"])
                if checkpoint_dir is not None and (due or stop["stop"]):
                    extra = dict(checkpoint_extra or {}, step=i + 1, seed=seed, global_batch=global_batch)
                    engine.save_checkpoint(checkpoint_dir, extra=extra)
                if stop["stop"] and i + 1 < steps:
                    where = Path(checkpoint_dir) if checkpoint_dir is not None else None
                    raise TrainingInterrupted(i + 1, where)
    finally:
        _close(bar, log)
        for reporter in reporters:
            reporter.close()
    engine.synchronize()  # the model the caller holds reflects every step
    return records


def _any_rank(replicas: Any, flag: bool) -> bool:
    """Whether any rank asks to stop (collective); a peer that failed meanwhile is named by the
    watchdog (which, by default, ends this process with that line)."""
    try:
        return bool(replicas.host.any_flag(flag))
    except Exception as exc:
        verdict = replicas.explain_failure(exc)
        if verdict is None:
            raise
        raise WorkerError(verdict) from exc


def _open_log(path: Path, append: bool) -> IO[str]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("a" if append else "w", encoding="utf-8")
    except OSError as exc:
        raise _write_error(path, exc) from exc


def _progress_bar(steps: int, start_step: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=steps, initial=start_step, desc="training", unit="step", dynamic_ncols=True, leave=True)


def _run_step(engine: Engine, batch: dict[str, torch.Tensor], step_lr: float, i: int, epoch: int,
              proc: psutil.Process) -> dict:
    """One optimizer step at ``step_lr``, and its record (see :func:`train`)."""
    t0 = time.perf_counter()
    result = engine.step(batch, lr=step_lr)
    seconds = max(result.seconds, time.perf_counter() - t0)
    rss = proc.memory_info().rss
    return {
        "step": i + 1,
        "epoch": epoch,
        "loss": float(result.loss),
        "lr": step_lr,
        "grad_norm": float(result.grad_norm),
        "tokens": int(result.tokens),
        "seconds": seconds,
        "tokens_per_s": result.tokens / seconds if seconds > 0 else float("nan"),
        "rss_bytes": int(rss),
        "h2d_gbs": result.h2d_bytes / seconds / 1e9 if seconds > 0 else 0.0,
        "d2h_gbs": result.d2h_bytes / seconds / 1e9 if seconds > 0 else 0.0,
        "gpu_peak_allocated": int(result.device_peak_allocated),
        "gpu_peak_reserved": int(result.device_peak_reserved),
        "clipped": bool(result.clipped),
        "skipped": bool(result.skipped),
        **_ssd_fields(result),
    }


def _ssd_fields(result: Any) -> dict:
    """The SSD tier's bytes and GB/s of the step (only when it moved any: Config.offload_dir)."""
    if not (result.ssd_read_bytes or result.ssd_write_bytes):
        return {}
    return {"ssd_read_bytes": int(result.ssd_read_bytes), "ssd_write_bytes": int(result.ssd_write_bytes),
            "ssd_read_gbs": float(result.ssd_read_gbps), "ssd_write_gbs": float(result.ssd_write_gbps)}


def _write_record(log: IO[str], record: dict, i: int) -> None:
    """One JSON line, flushed: a crashed run keeps its metrics."""
    try:
        log.write(json.dumps(record) + "\n")
        log.flush()
    except OSError as exc:
        raise _write_error(Path(log.name), exc, i) from exc


def _show_progress(bar: Any, record: dict, last_eval: float | None = None) -> None:
    link = (f" up={record['h2d_gbs']:.1f}GB/s down={record['d2h_gbs']:.1f}GB/s"
            f" gpu={_fmt_bytes(record['gpu_peak_reserved'])}") if record["gpu_peak_reserved"] else ""
    if "ssd_read_bytes" in record:
        link += f" ssd r={record['ssd_read_gbs']:.1f} w={record['ssd_write_gbs']:.1f}GB/s"
    held = f" eval={last_eval:.4f}" if last_eval is not None else ""
    bar.set_postfix_str(
        f"loss={record['loss']:.4f}{held} lr={record['lr']:.2e} "
        f"tok/s={record['tokens_per_s']:.0f}{link} host={_fmt_bytes(record['rss_bytes'])}",
        refresh=False,
    )
    bar.update(1)


def _close(bar: Any, log: IO[str] | None) -> None:
    if bar is not None:
        bar.close()
    if log is not None:
        try:
            log.close()
        except OSError:  # the write that failed was already reported
            pass


def _write_error(path: Path, exc: OSError, step: int | None = None) -> WriteError:
    from tinypipe.write_errors import describe as describe_os_error

    at = f" after step {step + 1}" if step is not None else ""
    return WriteError(f"cannot write {path}{at}: {describe_os_error(exc)}")


def _check_vocabulary(engine: Engine, dataset: PackedDataset) -> None:
    """Token ids the model has no embedding row for mean the tokenizer is not the model's: say so
    before the first step instead of failing inside it."""
    vocab = getattr(getattr(getattr(engine, "model", None), "config", None), "vocab_size", None)
    ids = getattr(dataset, "input_ids", None)
    if vocab is None or ids is None or ids.numel() == 0:
        return
    top = int(ids.max())
    if top >= int(vocab):
        raise ConfigError(
            f"the data holds token id {top} but the model's embedding has {vocab} rows: "
            "the tokenizer does not match the model (use the tokenizer saved with the model)"
        )


def read_metrics(path: str | os.PathLike[str]) -> list[dict]:
    """The records of a metrics JSONL file written by :func:`train`.

    A process killed while writing a record leaves a torn last line: it is ignored (that step
    never reached its checkpoint, so a resumed run redoes it). A bad line elsewhere is an error.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f if line.strip()]
    records = []
    for n, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            if n == len(lines) and not line.endswith("\n"):
                break
            raise ConfigError(f"{path}:{n}: not a metrics record") from None
    return records
