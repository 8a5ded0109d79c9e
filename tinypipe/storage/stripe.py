"""Striping the SSD tier over several offload directories, one per drive.

One drive serves a step's reads and writes in turn (measured on the GPU machine: 1.30-1.34 GB/s
read and 2.25-2.37 write alone, 1.81-1.87 GB/s together), so a step that moves S bytes each way
cannot beat 2S / (mixed rate) on it. Several drives add their rates -- if one layer's read uses all
of them at once. Hence each *region* is cut into the store's requests (``chunk_bytes``, 16 MiB:
the size at which one drive already reached its rate) and the chunks go round-robin over the
directories, starting at the one with the least data so far. A layer's state is hundreds of MiB
(a 7B layer's fp32 master is 810 MB: 49 chunks), so its read keeps every drive busy with requests
of the size each drive wants. Placing whole regions instead would put a layer's three regions
(master, two moments) on three drives: with 12 drives one layer's read would use a quarter of
them, and the step's read lane reads layer after layer. Regions smaller than a chunk go whole to
the least-filled directory, which spreads them too. With one directory the layout is the
single-file layout it always was.

Free space: each directory must hold its share (the layout says exactly how much), and
directories on one filesystem must hold their shares together.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tinypipe.errors import StorageError
from tinypipe.storage.direct import align_up
from tinypipe.storage.scratch import check_free_space, format_bytes, free_bytes, notice

PathLike = str | os.PathLike


class DirectorySet(tuple):
    """Several offload directories (a tuple of str); ``str()`` joins them with commas, the CLI's
    form, so messages and printed plans read ``/a, /b`` rather than a tuple's repr."""

    def __str__(self) -> str:
        return ", ".join(self)


def as_directories(value: PathLike | Sequence[PathLike]) -> tuple[str, ...]:
    """The offload directories ``value`` names: one path, or a sequence of them (at least one,
    none twice). A string is always one path (commas included: that split is the CLI's)."""
    items = [value] if isinstance(value, (str, os.PathLike)) else list(value)
    if not items:
        raise StorageError("no offload directory given")
    out: list[str] = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)) or not str(os.fspath(item)).strip():
            raise StorageError(f"offload directory must be a path, got {item!r}")
        out.append(os.fspath(item))
    seen: dict[str, str] = {}
    for d in out:
        real = os.path.realpath(d)
        if real in seen:
            raise StorageError(f"offload directory {d} is listed twice (as {seen[real]} too)")
        seen[real] = d
    return tuple(out)


def parse_directories(text: str) -> str | DirectorySet:
    """``--offload-dir A,B``: the directories of a comma-separated list, ``~`` expanded; one
    directory stays a plain string."""
    parts = [os.path.expanduser(p.strip()) for p in str(text).split(",") if p.strip()]
    if not parts:
        raise StorageError(f"--offload-dir needs a directory (or A,B for several), got {text!r}")
    dirs = as_directories(parts)
    return dirs[0] if len(dirs) == 1 else DirectorySet(dirs)


def describe(value: PathLike | Sequence[PathLike] | None) -> str:
    """``/a`` or ``/a, /b`` for messages."""
    if value is None:
        return ""
    return ", ".join(as_directories(value))


@dataclass(frozen=True)
class Extent:
    """Where one region's bytes are: chunk ``j`` is on drive ``(first + j) % drives`` at
    ``bases[drive] + (j // drives) * chunk_bytes`` (each drive's chunks of the region are
    contiguous in its file)."""

    nbytes: int
    first: int
    bases: tuple[int, ...]  # per drive; () for a region outside the scratch files

    def chunks(self, chunk_bytes: int) -> list[tuple[int, int, int, int]]:
        """``(start in the region, length, drive, file offset)`` of every chunk, in order."""
        n = len(self.bases)
        out = []
        for j, start in enumerate(range(0, self.nbytes, chunk_bytes)):
            drive = (self.first + j) % n
            out.append((start, min(chunk_bytes, self.nbytes - start), drive,
                        self.bases[drive] + (j // n) * chunk_bytes))
        return out


def stripe_layout(regions: Mapping[Hashable, int], drives: int,
                  chunk_bytes: int) -> tuple[dict[Hashable, Extent], list[int]]:
    """Each region's :class:`Extent` (in the mapping's order) and each drive's file size.

    Chunk lengths are multiples of a page except a region's last, which is rounded up: every
    chunk starts on a page boundary of its file, as direct I/O needs."""
    sizes = [0] * drives
    layout: dict[Hashable, Extent] = {}
    for key, nbytes in regions.items():
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"region {key!r} has negative size {nbytes}")
        first = min(range(drives), key=lambda d: (sizes[d], d))
        bases = tuple(sizes)
        layout[key] = Extent(nbytes, first, bases)
        for j, start in enumerate(range(0, nbytes, chunk_bytes)):
            sizes[(first + j) % drives] += align_up(min(chunk_bytes, nbytes - start))
    return layout, sizes


def _device(path: Path) -> int:
    return os.stat(path).st_dev


def check_shares(dirs: Sequence[Path], shares: Sequence[int], what: str = "the SSD tier") -> None:
    """Refuse in one line, naming the directory, when one cannot hold its share or directories on
    one filesystem cannot hold theirs together. Says (one ``tinypipe:`` line) when directories
    share a filesystem: striping over them adds no drive."""
    for d, share in zip(dirs, shares):
        check_free_space(d, share, what)
    groups: dict[int, list[int]] = {}
    for i, d in enumerate(dirs):
        groups.setdefault(_device(d), []).append(i)
    for members in groups.values():
        if len(members) < 2:
            continue
        names = ", ".join(str(dirs[i]) for i in members)
        need = sum(shares[i] for i in members)
        have = free_bytes(dirs[members[0]])
        if have is not None and have < need:
            raise StorageError(f"offload directories {names} share one filesystem with {format_bytes(have)} "
                               f"free; {what} needs {format_bytes(need)} ({need} bytes) there: free space or "
                               "choose directories on other drives")
        notice(f"offload directories {names} are on one filesystem: striping over them adds no drive")
