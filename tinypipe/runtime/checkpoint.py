"""Atomic training checkpoints: master weights, AdamW moments and step counts per layer, plus
whatever the caller needs to resume exactly (LR schedule position, data position, RNG states).

A checkpoint is a directory: one safetensors file per layer and ``state.json``. It is written to a
temporary sibling directory, flushed, and swapped in with renames, so a crash or kill at any
moment leaves either the previous checkpoint or the new one -- never a mixture. A write that fails
(disk full, permissions) removes its temporary directory, keeps the previous checkpoint and raises
:class:`CheckpointWriteError` (one line).
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from tinypipe.errors import ConfigError, WriteError
from tinypipe.memory.host_store import HostStore
from tinypipe.runtime.checksums import BackgroundHasher, verify
from tinypipe.runtime.exit_guard import ExitGuard
from tinypipe.runtime.optim.counters import set_layer_step
from tinypipe.safe_paths import inside
from tinypipe.write_errors import describe as describe_os_error  # noqa: F401 - its old home
from tinypipe.write_errors import os_errors

FORMAT = 1

# Test hook: called with the phase name at each step of a save ("layer" after each layer file -- a
# sharded save's shard files too --
# "written" when the temporary directory is complete, "moved-old" between moving the previous
# checkpoint aside and moving the new one in, "swapped" after that, "done" at the end). Tests use
# it to pause the writer (so a SIGKILL lands mid-write) or to raise OSError(ENOSPC).
FAULT_HOOK: Callable[[str], None] | None = None


class CheckpointWriteError(WriteError):
    """Writing a checkpoint failed (disk full, permissions); the previous checkpoint is intact."""


def phase(name: str) -> None:
    """Call :data:`FAULT_HOOK` (tests) at the save phase ``name``."""
    if FAULT_HOOK is not None:
        FAULT_HOOK(name)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(store: HostStore, step_count: int, path: str | os.PathLike,
                    extra: dict[str, Any] | None = None, guard: ExitGuard | None = None) -> Path:
    """Write the training state of ``store`` to directory ``path`` atomically.

    Raises :class:`CheckpointWriteError` when the write fails; the previous checkpoint survives.
    ``guard``: a process exit from another thread meanwhile removes the partial write, or waits
    for the swap (:mod:`~tinypipe.runtime.exit_guard`).
    """
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    try:
        with os_errors():  # safetensors' full disk is an OSError here
            return _save(store, step_count, final, tmp, extra, guard)
    except OSError as exc:
        if isinstance(exc, CheckpointWriteError):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # free the space the partial write took
        kept = find_checkpoint(final)
        survivor = f"; the previous checkpoint {kept} is intact" if kept is not None else ""
        raise CheckpointWriteError(f"cannot write checkpoint {final}: {describe_os_error(exc)}"
                                   f"{survivor}") from exc


def writing(guard: ExitGuard | None, tmp: Path, create: bool) -> AbstractContextManager[None]:
    """``guard.writing`` (without a guard: make ``tmp`` as asked, nothing else)."""
    if guard is not None:
        return guard.writing(tmp, create)
    if create:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    return nullcontext()


def committing(guard: ExitGuard | None, tmp: Path) -> AbstractContextManager[None]:
    return guard.committing(tmp) if guard is not None else nullcontext()


def _save(store: HostStore, step_count: int, final: Path, tmp: Path, extra: dict[str, Any] | None,
          guard: ExitGuard | None) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    with writing(guard, tmp, create=True):
        _write(store, step_count, tmp, extra)
        with committing(guard, tmp):
            swap_in(tmp, final)
    phase("done")
    return final


def _write(store: HostStore, step_count: int, tmp: Path, extra: dict[str, Any] | None) -> None:
    """The layer files and state.json of a checkpoint, into the (existing, empty) ``tmp``."""
    layers = []
    with BackgroundHasher() as hasher:  # each file hashed while the next is written
        for i, s in enumerate(store.iter_layers()):  # state on the SSD: read one layer at a time
            fresh = s.step == 0  # moments are uninitialised until a layer's first step
            tensors = {
                "master": s.master,
                "exp_avg": torch.zeros_like(s.exp_avg) if fresh else s.exp_avg,
                "exp_avg_sq": torch.zeros_like(s.exp_avg_sq) if fresh else s.exp_avg_sq,
            }
            name = f"layer-{i:04d}.safetensors"
            save_file(tensors, str(tmp / name))
            with open(tmp / name, "rb+") as f:
                os.fsync(f.fileno())
            hasher.submit(tmp / name)
            layers.append({"name": s.spec.name, "numel": s.spec.numel, "train_numel": s.spec.train_numel,
                           "step": s.step, "file": name})
            phase("layer")
        digests = hasher.digests()
    for entry in layers:
        entry["sha256"] = digests[entry["file"]]
    state = {"format": FORMAT, "step_count": step_count, "layers": layers, "extra": extra or {}}
    with open(tmp / "state.json", "w") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    phase("written")


def swap_in(tmp: Path, final: Path) -> None:
    """Replace the checkpoint ``final`` by the complete directory ``tmp`` with renames.

    Invariant: at every instant ``final`` or ``old`` is a complete checkpoint. ``final`` only ever
    appears by renaming a complete ``tmp``; ``old`` only by renaming a complete ``final``; ``old`` is
    deleted only while ``final`` exists. (When a kill landed between the two renames last time,
    ``final`` is missing and ``old`` is the current checkpoint: keep it until the new one is in
    place.) A ``final`` or ``old`` that tinypipe did not write is never moved or deleted: one-line
    ConfigError instead (the new checkpoint stays in ``tmp``)."""
    old = final.with_name(final.name + ".old")
    for existing in (final, old):
        if is_foreign(existing):
            raise ConfigError(f"{existing}: exists and is not a tinypipe checkpoint; tinypipe writes its "
                              "checkpoints there and would replace it: move it away or choose another "
                              "--output")
    if final.exists():
        if old.exists():
            remove_checkpoint(old)
        os.replace(final, old)
        _fsync_dir(final.parent)
    phase("moved-old")
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    phase("swapped")
    if old.exists():
        remove_checkpoint(old)


#: The files that mark a directory as a tinypipe checkpoint (:func:`is_tinypipe_checkpoint`).
MARKERS = ("state.json", "manifest.json")


def remove_checkpoint(path: Path) -> None:
    """Delete the tinypipe checkpoint directory ``path``, its marker files last: a kill part-way
    leaves a directory tinypipe still recognises as its own (and deletes at the next save), not a
    marker-less remainder that the output guard must refuse as foreign on ``--resume``."""
    for entry in sorted(path.iterdir()):
        if entry.name in MARKERS:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    for name in MARKERS:
        (path / name).unlink(missing_ok=True)
    path.rmdir()


def is_foreign(path: str | os.PathLike) -> bool:
    """Whether ``path`` exists and holds something tinypipe did not write: not one of its
    checkpoints, and not the empty directory a kill between deleting one's markers and the
    directory itself leaves (:func:`remove_checkpoint`)."""
    p = Path(path)
    if not p.exists() or is_tinypipe_checkpoint(p):
        return False
    return not (p.is_dir() and not any(p.iterdir()))


def is_tinypipe_checkpoint(path: str | os.PathLike) -> bool:
    """Whether directory ``path`` is a checkpoint tinypipe wrote (a ``state.json`` or a sharded
    ``manifest.json`` with its format and layers): only those are ever replaced or deleted."""
    for name in MARKERS:
        try:
            record = json.loads((Path(path) / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and "format" in record and "layers" in record:
            return True
    return False


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """The complete checkpoint at ``path``, or the previous one if a save was interrupted mid-swap."""
    final = Path(path)
    for candidate in (final, final.with_name(final.name + ".old")):
        if (candidate / "state.json").is_file():
            return candidate
    return None


def check_layout(store: HostStore, path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """The checkpoint at ``path`` (its directory and state.json) if it holds ``store``'s layers;
    one-line ConfigError if it is missing, unreadable, or for another model or LoRA setting."""
    found = find_checkpoint(path)
    if found is None:
        raise ConfigError(f"{path}: no checkpoint here (no state.json)")
    try:
        state = json.loads((found / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{found}/state.json: unreadable checkpoint ({exc})") from exc
    if state.get("format") != FORMAT or len(state.get("layers", [])) != len(store.layers):
        raise ConfigError(f"{found}: checkpoint is for a different model or format")
    for s, entry in zip(store.layers, state["layers"]):
        if entry["numel"] != s.spec.numel or entry["name"] != s.spec.name:
            raise ConfigError(f"{found}: layer {entry['name']} does not match this model's {s.spec.name}")
        trained = entry.get("train_numel", entry["numel"])
        if trained != s.spec.train_numel:
            kind = {True: "LoRA", False: "full fine-tuning"}
            raise ConfigError(f"{found}: checkpoint of {kind[trained < entry['numel']]} "
                              f"(layer {s.spec.name}: {trained} trained elements), this run is "
                              f"{kind[s.spec.frozen_numel > 0]} ({s.spec.train_numel}): same --lora settings "
                              "needed")
    return found, state


def load_checkpoint(store: HostStore, path: str | os.PathLike) -> tuple[int, dict[str, Any]]:
    """Restore ``store`` from a checkpoint; returns (step_count, extra)."""
    found, state = check_layout(store, path)
    for i, (s, entry) in enumerate(zip(store.layers, state["layers"])):
        path = inside(found, entry["file"], found / "state.json")
        verify(path, entry.get("sha256"))
        try:
            tensors = load_file(str(path))
        except Exception as exc:  # noqa: BLE001 - a damaged file: one line, not a traceback
            detail = " ".join(str(exc).split())
            raise ConfigError(f"{path}: unreadable checkpoint file ({detail})") from exc
        _check_sizes(path, tensors, {"master": s.spec.train_numel, "exp_avg": s.spec.train_numel,
                                     "exp_avg_sq": s.spec.train_numel})
        # into DRAM, or written to the SSD where the state lives there (scratch is never a checkpoint)
        store.restore_layer(i, tensors["master"], tensors["exp_avg"], tensors["exp_avg_sq"])
        set_layer_step(s, int(entry["step"]))
    return int(state["step_count"]), dict(state.get("extra", {}))


def _check_sizes(path: Path, tensors: dict[str, torch.Tensor], numel: dict[str, int]) -> None:
    """One-line ConfigError when a layer file lacks a tensor or holds one of another size."""
    for name, want in numel.items():
        got = tensors.get(name)
        if got is None or got.numel() != want:
            have = "missing" if got is None else f"{got.numel()} elements"
            raise ConfigError(f"{path}: {name} is {have}, this layer has {want}: the file is from another "
                              "checkpoint or model")


def read_extra(path: str | os.PathLike) -> dict[str, Any]:
    """The ``extra`` a checkpoint was saved with (its state.json only; no tensors are read)."""
    found = find_checkpoint(path)
    if found is None:
        raise ConfigError(f"{path}: no checkpoint here (no state.json)")
    try:
        return dict(json.loads((found / "state.json").read_text()).get("extra", {}))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{found}/state.json: unreadable checkpoint ({exc})") from exc


def _canonical(value: Any) -> Any:
    """JSON's view of ``value`` (tuples become lists), so a loaded setting compares equal."""
    return json.loads(json.dumps(value))


def setting_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"name: A in the checkpoint, B now"`` for every setting both record with different values
    (a setting an older checkpoint did not record is not compared)."""
    out = []
    for name, now in current.items():
        if name in recorded and _canonical(recorded[name]) != _canonical(now):
            out.append(f"{name}: {_show(recorded[name])} in the checkpoint, {_show(now)} now")
    return out


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(_show(v) for v in value)
    if isinstance(value, dict):
        return " ".join(f"{k}={_show(v)}" for k, v in value.items())
    return str(value)
