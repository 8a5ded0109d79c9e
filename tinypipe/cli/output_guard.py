"""``finetune --output`` and ``demo --output``: refuse, before the model loads, to write where it would
destroy what is there.

A fresh run (no ``--resume``) into a directory holding a tinypipe checkpoint or a saved model would
replace them (the first checkpoint rotates the old one away, the final save overwrites the model):
``--resume`` continues, ``--overwrite`` says to replace them. A ``checkpoint`` directory tinypipe did
not write would be deleted by that rotation, and ``--output`` equal to ``--model`` would overwrite
the original weights: both are refused even with ``--overwrite`` (tinypipe never deletes what it did
not write). Each refusal is one line naming the way out.
"""

from __future__ import annotations

import json
from pathlib import Path

from tinypipe.errors import ConfigError

CHECKPOINT = "checkpoint"
#: What a finished run leaves besides its checkpoint (a fresh run would overwrite it). Not metrics.jsonl
#: alone: a run killed before its first checkpoint leaves only that, and is started again as it was.
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")


def refuse_model_dir(out: Path, model: Path) -> None:
    """One-line ConfigError if ``out`` is the model directory ``model`` (checked before anything is
    written to ``out``; a .gguf file's directory is fine: its file is never overwritten)."""
    if out.exists() and _same_dir(out, model):
        raise ConfigError(f"--output {out} is the --model directory: saving would overwrite the original "
                          "weights; choose another --output")


def check_output(out: Path, *, resume: bool, overwrite: bool, resumable: bool = True) -> None:
    """One-line ConfigError if writing a run into ``out`` would lose something. ``resumable``: the
    command has ``--resume`` to offer (``tinypipe demo`` has not: its refusal names --overwrite only)."""
    if resume and overwrite:
        raise ConfigError("give --resume (continue the checkpoint) or --overwrite (start over), not both")
    for name in (CHECKPOINT, CHECKPOINT + ".old"):
        foreign = out / name
        if _is_foreign(foreign):
            raise ConfigError(f"{foreign}: exists and was not written by tinypipe (no tinypipe state.json), "
                              "and tinypipe keeps its checkpoints there: move it away or choose another "
                              "--output")
    if resume or overwrite:
        return
    step = _checkpoint_step(out)
    if step is not None:
        way = ("--resume continues it, --overwrite starts a new run over it" if resumable else
               "--overwrite starts a new run over it, or choose another --output")
        raise ConfigError(f"--output {out} holds the checkpoint of a run (step {step}): {way}")
    found = [name for name in MODEL_FILES if (out / name).exists()]
    if found:
        raise ConfigError(f"--output {out} holds the output of an earlier run ({', '.join(found)}): "
                          "--overwrite replaces it, or choose another --output")


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve().samefile(b.resolve())
    except OSError:
        return False


def _is_foreign(path: Path) -> bool:
    from tinypipe.runtime.checkpoint import is_foreign  # torch: not at import

    return is_foreign(path)


def _checkpoint_step(out: Path) -> int | str | None:
    """The step of the tinypipe checkpoint in ``out`` (``"?"`` when unreadable), None when there is none."""
    for name in (CHECKPOINT, CHECKPOINT + ".old"):
        for record in ("state.json", "manifest.json"):
            path = out / name / record
            if not path.is_file():
                continue
            try:
                return int(json.loads(path.read_text()).get("extra", {}).get("step", "?"))
            except (OSError, ValueError, AttributeError):
                return "?"
    return None
