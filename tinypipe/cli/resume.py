"""``finetune --resume``: what a checkpoint records of the run that made it, and the check that the
resumed run is the same run.

A changed learning rate, schedule, step count, data file, model, LoRA setting (QLoRA's
quantization included), packing, dropout, held-out split, seed or global batch -- and, recorded
by the engine itself, precision, AdamW settings and the weight-decay grouping -- would silently
continue a different run from the checkpoint. Each is recorded; a resume that differs stops with
one line naming every difference, unless ``--force`` (which says what it overrides).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tinypipe.errors import ConfigError

HASHED_BYTES = 4 * 1024 * 1024  # the data file's first 4 MiB are hashed (with its size: cheap, telling)


def file_fingerprint(path: Path) -> str:
    """``size:sha256(first 4 MiB)`` of ``path`` (one line, compared as a whole)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(HASHED_BYTES))
    return f"{path.stat().st_size} bytes, sha256 of the first 4 MiB {digest.hexdigest()[:16]}"


def run_settings(s: dict[str, Any], data_path: Path, steps: int, lora: Any) -> dict[str, Any]:
    """The settings a checkpoint of this run records (``extra["run"]``), by readable name."""
    lora_text = "off" if lora is None else (
        f"rank {lora.rank}, alpha {lora.alpha:g}, dropout {lora.dropout:g}, "
        f"targets {','.join(lora.targets) if lora.targets else 'default'}"
        + (f", quantize {lora.quantize}" if lora.quantize else ""))
    return {
        "model": str(Path(s["model"]).expanduser().resolve()),
        "data file": str(data_path.resolve()),
        "data content": file_fingerprint(data_path),
        "eval split": s["eval_split"],
        "steps": steps,
        "lr": s["lr"],
        "schedule": s["schedule"],
        "warmup steps": s["warmup_steps"],
        "min lr ratio": s["min_lr_ratio"],
        "lora": lora_text,
        "packing": s["packing"],
        "dropout": "off" if s["no_dropout"] else "on",
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
