"""Training state that lives on the SSD instead of in DRAM: its regions, their scratch file, and
which of them hold data.

A plan's ``offload`` names (layer, kind) pairs; each becomes one or two *regions* of the run's
scratch file (:class:`~tinypipe.storage.SsdStateStore`): ``(layer, "master")``, ``(layer,
"exp_avg")`` + ``(layer, "exp_avg_sq")`` for the moments, ``(layer, "grad")`` for the retained
gradient, ``(layer, "frozen")`` for a LoRA layer's frozen base weights. The host store creates
this object before it allocates anything, so a missing directory or too little free space fails
first, with one line.

"Written" is tracked here rather than asked of the store: the store calls a region valid only
once its write *completed*, but it also orders requests per region, so a read issued after a
write (still in flight) sees that write. Moments that were never written need no read: the
first AdamW step zeroes them (as it does in DRAM, where they start uninitialised).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence

import torch

from tinypipe.devices.host_buffers import aligned_empty
from tinypipe.storage import SsdStateStore
from tinypipe.storage.frozen_source import ExternalRegion
from tinypipe.storage.scratch import Leftover, sweep_stale
from tinypipe.storage.stripe import as_directories

#: The store's regions per plan kind (names of :class:`~tinypipe.memory.host_store.LayerState`
#: fields, plus the retained gradient).
REGIONS_OF: dict[str, tuple[str, ...]] = {
    "master": ("master",), "moments": ("exp_avg", "exp_avg_sq"), "grad": ("grad",), "frozen": ("frozen",),
}

Key = tuple[int, str]


class OffloadedState:
    """The SSD regions of one engine: ``regions`` maps (layer, name) to (numel, dtype)."""

    def __init__(self, directory: str | os.PathLike | Sequence[str | os.PathLike],
                 regions: Mapping[Key, tuple[int, torch.dtype]],
                 external: Mapping[Key, ExternalRegion] | None = None) -> None:
        """``directory``: one offload directory or several (one per drive, striped); ``external``:
        regions read from the model's own checkpoint (never in the scratch files)."""
        self.regions = {k: (int(n), dt) for k, (n, dt) in regions.items() if n > 0}
        self.external = dict(external or {})
        dirs = as_directories(directory)
        self.swept: list[Leftover] = [x for d in dirs for x in sweep_stale(d)]  # one stderr line each
        nbytes = {k: n * _itemsize(dt) for k, (n, dt) in self.regions.items() if k not in self.external}
        self.ssd = SsdStateStore(dirs, nbytes, external=self.external)  # checks each directory's space
        self._written: set[Key] = set(self.external)  # the checkpoint holds their values already
        self._lock = threading.Lock()

    # -- facts ------------------------------------------------------------------------------------
    def has(self, layer: int, name: str) -> bool:
        return (layer, name) in self.regions

    def names(self, layer: int) -> list[str]:
        """The region names of ``layer`` on the SSD, in LayerState field order."""
        order = ("master", "exp_avg", "exp_avg_sq", "grad", "frozen")
        return [n for n in order if (layer, n) in self.regions]

    def numel(self, key: Key) -> int:
        return self.regions[key][0]

    def dtype(self, key: Key) -> torch.dtype:
        return self.regions[key][1]

    def nbytes(self, key: Key) -> int:
        n, dt = self.regions[key]
        return n * _itemsize(dt)

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes on the SSD per plan kind (for the memory report)."""
        out: dict[str, int] = {}
        for key in self.regions:
            kind = next(k for k, names in REGIONS_OF.items() if key[1] in names)
            out[kind] = out.get(kind, 0) + self.nbytes(key)
        return out

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes(k) for k in self.regions)

    def written(self, key: Key) -> bool:
        """Whether a write of ``key`` was issued (a later read sees it); never-written moments are
        zeroed by their first step instead of read."""
        with self._lock:
            return key in self._written

    def mark_written(self, keys: Iterable[Key]) -> None:
        with self._lock:
            self._written.update(keys)

    # -- synchronous transfers (start-up, checkpoints, readers) -----------------------------------
    def read_new(self, key: Key) -> torch.Tensor:
        """A fresh page-aligned DRAM copy of region ``key`` (uninitialised if it was never written)."""
        n, dt = self.regions[key]
        out = aligned_empty(n, dt)
        if self.written(key):
            self.ssd.read(key, out)
        return out

    def write(self, key: Key, src: torch.Tensor) -> None:
        """Write ``src`` (page-aligned, CPU) to region ``key`` and wait for it."""
        self.ssd.write(key, src)
        self.mark_written([key])

    def write_copy(self, key: Key, src: torch.Tensor) -> None:
        """Write any CPU tensor's values to region ``key`` (through an aligned copy if needed)."""
        flat = src.detach().reshape(-1)
        if flat.data_ptr() % 4096 == 0 and flat.is_contiguous() and flat.dtype == self.dtype(key):
            self.write(key, flat)
            return
        buf = aligned_empty(self.numel(key), self.dtype(key))
        buf.copy_(flat)
        self.write(key, buf)

    def close(self) -> None:
        """Finish I/O in flight and remove the scratch files and directories (idempotent)."""
        self.ssd.close()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
