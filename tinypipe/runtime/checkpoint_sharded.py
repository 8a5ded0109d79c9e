"""Checkpoints of data-parallel replicas.

Replicated state: every rank holds the same state, so rank 0 writes the ordinary checkpoint
(:mod:`tinypipe.runtime.checkpoint`) between two barriers and every rank resumes from it.

Sharded state: each rank writes its shard of every layer (master slice, moments) into
``<dir>.tmp/rank-<r>-of-<R>/``, fsynced; after a barrier (every rank finished writing) rank 0
writes ``manifest.json`` and swaps the directory in with the same renames as an ordinary
checkpoint, then a last barrier: a checkpoint counts only once every rank's shard is on disk, and
a kill at any moment leaves the previous complete one. Resuming needs the same world size: each
rank reads its shard and the masters are all-gathered, so every rank's state is bit-identical to
the one saved. The directory must be visible to every rank (one node, or a shared file system).

Integrity: each rank hashes its shard files while writing them (:mod:`~tinypipe.runtime.checksums`),
rank 0 records every rank's sha256 in the manifest (``sha256``: ``rank-.../layer-....safetensors`` ->
hex) and, resuming, each rank checks its own files before loading them; the ranks then agree, so a
damaged shard is refused on every rank with the same one line naming the file (no rank left
waiting in the masters' all-gather).
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tinypipe.distributed.group import Replicas
from tinypipe.errors import ConfigError
from tinypipe.memory.host_store import HostStore
from tinypipe.runtime.checkpoint import (CheckpointWriteError, committing, describe_os_error, find_checkpoint,
                                         load_checkpoint, phase, save_checkpoint, swap_in, writing)
from tinypipe.runtime.checksums import BackgroundHasher, verify
from tinypipe.runtime.exit_guard import ExitGuard
from tinypipe.runtime.optim.counters import set_layer_step
from tinypipe.runtime.optim.path import OptimizerPath
from tinypipe.runtime.optim.sharded import ShardedOptimizerPath
from tinypipe.write_errors import os_errors

MANIFEST = "manifest.json"
FORMAT = 1


def rank_dir(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}"


def save_sharded(store: HostStore, optimizer: ShardedOptimizerPath, replicas: Replicas,
                 path: str | os.PathLike, extra: dict[str, Any], guard: ExitGuard | None = None) -> Path:
    """Write this rank's shard; rank 0 commits the manifest once every rank has (collective).

    ``guard``: a process exit meanwhile removes the temporary directory -- rank 0's from its
    creation to its swap, another rank's while it writes its shard (rank 0 cannot be swapping then:
    it waits for that rank's vote) -- or waits for rank 0's swap."""
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    rank, world = replicas.rank, replicas.size
    failed = ""
    with ExitStack() as held:
        if rank == 0:
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                held.enter_context(writing(guard, tmp, create=True))
            except OSError as exc:
                failed = describe_os_error(exc)
        replicas.host.barrier()  # the temporary directory exists
        digests: dict[str, str] = {}
        if not failed:
            try:
                with os_errors(), writing(guard, tmp, create=False) if rank else nullcontext():
                    digests = _write_shard(store, optimizer, tmp / rank_dir(rank, world))
            except OSError as exc:
                failed = describe_os_error(exc)
        if replicas.host.any_flag(bool(failed)):  # every rank wrote its shard, or none commits
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(f"cannot write checkpoint {final}: "
                                       f"{failed or 'another rank could not write its shard'}")
        every = replicas.host.all_gather_object(digests)  # each rank's file -> sha256, for the manifest
        if rank == 0:
            sha256 = {name: digest for per_rank in every for name, digest in dict(per_rank).items()}
            _commit(store, optimizer, replicas, final, tmp, dict(extra), sha256, guard)
    replicas.host.barrier()  # the checkpoint is in place before any rank goes on
    return final


def _write_shard(store: HostStore, optimizer: ShardedOptimizerPath, where: Path) -> dict[str, str]:
    """Write this rank's shard files into ``where``; their sha256 by ``rank-.../layer-...`` name."""
    where.mkdir()
    view = optimizer.view
    with BackgroundHasher() as hasher:  # each file hashed while the next is written
        for i, s in enumerate(view.layers):
            fresh = s.step == 0  # moments are uninitialised until a layer's first step
            tensors = {
                "master": s.master.contiguous(),
                "exp_avg": torch.zeros_like(s.exp_avg) if fresh else s.exp_avg,
                "exp_avg_sq": torch.zeros_like(s.exp_avg_sq) if fresh else s.exp_avg_sq,
            }
            name = where / _layer_file(i)
            save_file(tensors, str(name))
            with open(name, "rb+") as f:
                os.fsync(f.fileno())
            hasher.submit(name)
            phase("layer")
        digests = hasher.digests()
    _fsync_dir(where)
    return {f"{where.name}/{name}": digest for name, digest in digests.items()}


def _layer_file(i: int) -> str:
    return f"layer-{i:04d}.safetensors"


def _commit(store: HostStore, optimizer: ShardedOptimizerPath, replicas: Replicas, final: Path, tmp: Path,
            extra: dict[str, Any], sha256: dict[str, str], guard: ExitGuard | None) -> None:
    view = optimizer.view
    layers = [{"name": s.spec.name, "numel": s.spec.numel, "train_numel": s.spec.train_numel,
               "sharded": i in view.shards, "step": view.layers[i].step}
              for i, s in enumerate(store.layers)]
    manifest = {"format": FORMAT, "world_size": replicas.size, "sharding": "shard",
                "step_count": optimizer.step_count, "layers": layers, "extra": extra, "sha256": sha256}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    with committing(guard, tmp):
        swap_in(tmp, final)  # the swap of runtime/checkpoint.py (same invariant)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def find_sharded(path: str | os.PathLike) -> Path | None:
    """The committed sharded checkpoint at ``path`` (or its previous one, mid-swap)."""
    final = Path(path)
    for candidate in (final, final.with_name(final.name + ".old")):
        if (candidate / MANIFEST).is_file():
            return candidate
    return None


def sharded_extra(path: str | os.PathLike) -> dict[str, Any] | None:
    """The ``extra`` a sharded checkpoint's manifest records (None: no sharded checkpoint there)."""
    found = find_sharded(path)
    if found is None:
        return None
    try:
        return dict(json.loads((found / MANIFEST).read_text()).get("extra", {}))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{found}/{MANIFEST}: unreadable checkpoint manifest ({exc})") from exc


def load_sharded(store: HostStore, optimizer: ShardedOptimizerPath, replicas: Replicas,
                 path: str | os.PathLike) -> tuple[int, dict[str, Any]]:
    """Restore this rank's shard and all-gather the masters; (step_count, extra)."""
    found = find_sharded(path)
    if found is None:
        plain = find_checkpoint(path)
        what = "a replicated (or single-process) checkpoint" if plain is not None else "no checkpoint"
        raise ConfigError(f"{path}: {what} here, this run shards its optimizer state over "
                          f"{replicas.size} ranks: resume with the settings it was saved with")
    manifest = json.loads((found / MANIFEST).read_text())
    if manifest.get("world_size") != replicas.size:
        raise ConfigError(f"{found}: saved by {manifest.get('world_size')} ranks, this run has "
                          f"{replicas.size}: resume a sharded checkpoint with the same world size")
    view = optimizer.view
    entries = manifest["layers"]
    if len(entries) != len(store.layers) or any(
            e["name"] != s.spec.name or e["train_numel"] != s.spec.train_numel
            or e["sharded"] != (i in view.shards) for i, (e, s) in enumerate(zip(entries, store.layers))):
        raise ConfigError(f"{found}: checkpoint is for a different model, LoRA setting or placement")
    where = found / rank_dir(replicas.rank, replicas.size)
    try:
        _load_shard(optimizer, where, entries, dict(manifest.get("sha256") or {}))
        problem = ""
    except ConfigError as exc:
        problem = str(exc)
    # every rank refuses with the first rank's line (none waits for a peer that stopped)
    problems = [str(p) for p in replicas.host.all_gather_object(problem) if p]
    if problems:
        raise ConfigError(problems[0])
    view.sync_steps(to_full=True)
    optimizer.gather_all()
    return int(manifest["step_count"]), dict(manifest.get("extra", {}))


def _load_shard(optimizer: ShardedOptimizerPath, where: Path, entries: list[dict[str, Any]],
                sha256: dict[str, str]) -> None:
    """Check (sha256, when the manifest records it) and load this rank's shard files from ``where``."""
    for i, (s, entry) in enumerate(zip(optimizer.view.layers, entries)):
        path = where / _layer_file(i)
        verify(path, sha256.get(f"{where.name}/{path.name}"), record="manifest.json")
        try:
            tensors = load_file(str(path))
        except Exception as exc:  # noqa: BLE001 - a damaged file: one line
            raise ConfigError(f"{where}: unreadable shard of layer {entry['name']} "
                              f"({' '.join(str(exc).split())})") from exc
        with torch.no_grad():
            s.master.copy_(tensors["master"])
            s.exp_avg.copy_(tensors["exp_avg"])
            s.exp_avg_sq.copy_(tensors["exp_avg_sq"])
        set_layer_step(s, int(entry["step"]))


def save_replicas(store: HostStore, optimizer: OptimizerPath, replicas: Replicas, step_count: int,
                  path: str | os.PathLike, extra: dict[str, Any], guard: ExitGuard | None = None) -> Path:
    """A replicas' checkpoint (every rank calls it): sharded, or rank 0's replicated state."""
    if isinstance(optimizer, ShardedOptimizerPath):
        return save_sharded(store, optimizer, replicas, path, extra, guard)
    replicas.host.barrier()
    failed: OSError | None = None
    if replicas.is_main:
        try:
            save_checkpoint(store, step_count, path, extra, guard)
        except OSError as exc:
            failed = exc
    if replicas.host.any_flag(failed is not None):  # raised on every rank
        if failed is not None:
            raise failed
        raise CheckpointWriteError(f"cannot write checkpoint {path}: rank 0 could not write it")
    return Path(path)


def load_replicas(store: HostStore, optimizer: OptimizerPath, replicas: Replicas,
                  path: str | os.PathLike) -> tuple[int, dict[str, Any]]:
    """Resume every rank from a replicas' checkpoint (the sharded or the replicated kind)."""
    if isinstance(optimizer, ShardedOptimizerPath):
        return load_sharded(store, optimizer, replicas, path)
    return load_checkpoint(store, path)
