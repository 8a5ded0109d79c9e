"""``finetune --resume``: what a checkpoint records of the run that made it, and the check that the
resumed run is the same run.

A changed learning rate, schedule, step count, sequence length, data file, model (its path and
its files' content: a base replaced at the same path is another model), LoRA setting (QLoRA's
quantization included), packing, dropout, held-out split, seed or global batch -- and, recorded
by the engine itself, precision, AdamW settings and the weight-decay grouping -- would silently
continue a different run from the checkpoint. Each is recorded; a resume that differs stops with
one line naming every difference, unless ``--force`` (which says what it overrides).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinypipe.errors import ConfigError

if TYPE_CHECKING:
    from tinypipe.cli.options import FinetuneSettings

HASHED_BYTES = 4 * 1024 * 1024  # the data file's first 4 MiB are hashed (with its size: cheap, telling)


def file_fingerprint(path: Path) -> str:
    """``size:sha256(first 4 MiB)`` of ``path`` (one line, compared as a whole)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(HASHED_BYTES))
    return f"{path.stat().st_size} bytes, sha256 of the first 4 MiB {digest.hexdigest()[:16]}"


SAMPLE_BYTES = 4 * 1024 * 1024
MODEL_SUFFIXES = (".safetensors", ".bin", ".gguf", ".json", ".pt")


def model_fingerprint(path: Path) -> str:
    """One line identifying the model files at ``path`` (a directory or a .gguf file): their count,
    total size and a sha256 over each file's name, size and its first, middle and last 4 MiB.

    Sampled, not whole: hashing a 140 GB model would add minutes to every start, and a model
    replaced at the same path differs in its safetensors header (first bytes) or its size; a
    tinypipe-sized test model (< 12 MiB per file) is hashed whole."""
    files = [path] if path.is_file() else sorted(
        f for f in path.iterdir() if f.is_file() and f.suffix in MODEL_SUFFIXES)
    digest = hashlib.sha256()
    total = 0
    for f in files:
        size = f.stat().st_size
        total += size
        digest.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as handle:
            for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                handle.seek(offset)
                digest.update(handle.read(SAMPLE_BYTES))
    return f"{len(files)} files, {total} bytes, sha256 of samples {digest.hexdigest()[:16]}"


def run_settings(s: FinetuneSettings, data_path: Path, steps: int, lora: Any,
                 seq_len: int) -> dict[str, Any]:
    """The settings a checkpoint of this run records (``extra["run"]``), by readable name."""
    lora_text = "off" if lora is None else (
        f"rank {lora.rank}, alpha {lora.alpha:g}, dropout {lora.dropout:g}, "
        f"targets {','.join(lora.targets) if lora.targets else 'default'}"
        + (f", quantize {lora.quantize}" if lora.quantize else ""))
    return {
        "model": str(Path(s.model).expanduser().resolve()),
        "model content": model_fingerprint(Path(s.model).expanduser().resolve()),
        "seq len": seq_len,
        "extend context": s.extend_context,
        "data file": str(data_path.resolve()),
        "data content": file_fingerprint(data_path),
        "eval split": s.eval_split,
        "steps": steps,
        "lr": s.lr,
        "schedule": s.schedule,
        "warmup steps": s.warmup_steps,
        "min lr ratio": s.min_lr_ratio,
        "lora": lora_text,
        "packing": s.packing,
        "dropout": "off" if s.no_dropout else "on",
    }


def resume_differences(extra: dict[str, Any], run: dict[str, Any], seed: int, global_batch: int) -> list[str]:
    """Every way this run differs from the one that wrote the checkpoint's ``extra``."""
    from tinypipe.runtime.checkpoint import setting_differences

    recorded = dict(extra.get("run", {}), seed=extra.get("seed"))
    recorded["global batch"] = extra.get("global_batch")
    return setting_differences(recorded, dict(run, seed=seed, **{"global batch": global_batch}))


def refuse_or_override(where: Path, differences: list[str], force: bool) -> str | None:
    """Raise ConfigError (one line) for a resume that differs, unless ``force``: then the line to
    print saying what is overridden (None when nothing differs)."""
    if not differences:
        return None
    listed = "; ".join(differences)
    if not force:
        raise ConfigError(f"{where}: --resume with other settings than the checkpoint's: {listed} "
                          "(the same command as the interrupted run resumes it; --force continues anyway)")
    return f"--force: resuming although {listed}"
