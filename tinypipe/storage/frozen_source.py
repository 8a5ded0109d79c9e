"""LoRA's frozen base read from the model's own safetensors files instead of a scratch copy.

When a layer's frozen weights go to the SSD (``Plan.offload`` kind ``"frozen"``) and the model was
loaded by tinypipe's streaming loader from safetensors, the bytes are already on a disk: the layer's
frozen region becomes an :class:`ExternalRegion` -- the byte ranges of its tensors in the checkpoint
files -- read straight into the staging slot (buffered ``preadv``: the ranges are not page-aligned)
and cast where the file stores another dtype than the compute dtype. No scratch space, no write at
start-up: a 70B LoRA base (140 GB in bf16) costs no scratch at all.

Exactness: the DRAM engine holds ``frozen = cast(param)``, where ``param`` was read from the file
and cast to fp32 by the loader; here the slot holds ``cast(file value)``. Both casts are exact or
round the same way (bf16/fp16 -> fp32 is exact, so fp32 -> compute dtype sees the file's value),
so the bytes are identical. What would break it is a parameter that no longer holds the file's
value; a parameter is used only when (1) it is the same tensor object the loader filled (marked
in its own ``__dict__``: a replaced parameter carries no mark), (2) its version counter has not
moved since (no in-place write through any view), and (3) a sample of its elements (the first
and the last :data:`VERIFY_ELEMENTS`) read back from the file equals it. Any layer that fails a
check keeps the scratch copy.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tinypipe.models.decompose import LayerSpec
from tinypipe.models.safetensors_stream import TensorEntry

#: The attribute the loader sets on each parameter it filled (in the tensor's own ``__dict__``:
#: it goes with that tensor object only -- a replaced parameter has none -- and holds no weakref,
#: which ``torch.utils.swap_tensors`` would refuse).
STORED_ATTR = "_tinypipe_stored"
#: Elements of each tensor compared with the file at start-up (head and tail).
VERIFY_ELEMENTS = 4096
#: Bytes per ``preadv`` call.
CHUNK_BYTES = 64 << 20


def record_stored(param: torch.Tensor, entry: TensorEntry) -> None:
    """Mark ``param`` as holding ``entry``'s values now (the loader, after filling it)."""
    param.__dict__[STORED_ATTR] = (entry, param._version)


def stored_entry(param: torch.Tensor) -> TensorEntry | None:
    """``param``'s entry while it still holds what the loader read (checks 1 and 2)."""
    got = param.__dict__.get(STORED_ATTR)
    if got is None or got[1] != param._version:
        return None
    return got[0]


@dataclass(frozen=True)
class Extent:
    """One stored tensor: its bytes in a checkpoint file and where its elements go in the region."""

    path: str
    file_offset: int
    file_dtype: torch.dtype
    dest: int  # first element in the region
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.file_dtype.itemsize


@dataclass(frozen=True)
class ExternalRegion:
    """A read-only region of ``numel`` elements of ``dtype`` assembled from checkpoint tensors;
    ``gaps`` (element ranges no tensor covers: alignment, the tail) read as zeros."""

    extents: tuple[Extent, ...]
    numel: int
    dtype: torch.dtype
    gaps: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.path for e in self.extents))

    def read_part(self, part: int, into: torch.Tensor, files: FileHandles) -> None:
        """Fill part ``part`` (an extent; the last part: the gaps) of the region held by ``into``
        (a CPU tensor of at least :attr:`nbytes` bytes, any dtype)."""
        region = into.reshape(-1).view(torch.uint8)[: self.nbytes].view(self.dtype)
        if part == len(self.extents):
            for lo, hi in self.gaps:
                region[lo:hi].zero_()
            return
        e = self.extents[part]
        dest = region[e.dest : e.dest + e.numel]
        if e.file_dtype == self.dtype:
            _pread(files.fd(e.path), dest.view(torch.uint8), e.file_offset)
        else:
            tmp = torch.empty(e.numel, dtype=e.file_dtype)
            _pread(files.fd(e.path), tmp.view(torch.uint8), e.file_offset)
            dest.copy_(tmp)

    @property
    def parts(self) -> int:
        return len(self.extents) + 1


def _pread(fd: int, out: torch.Tensor, offset: int) -> None:
    """Read ``out.numel()`` bytes at ``offset`` into the uint8 tensor ``out`` (short reads retried)."""
    view = memoryview(out.numpy())
    done, total = 0, out.numel()
    while done < total:
        n = os.preadv(fd, [view[done : min(total, done + CHUNK_BYTES)]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n


class FileHandles:
    """Read-only descriptors of the checkpoint files, opened once, closed with the store."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: str) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            return self._fds[path]

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def _sample_matches(param: torch.Tensor, entry: TensorEntry, dtype: torch.dtype, files: FileHandles) -> bool:
    """Check 3: the head and tail of ``entry`` in the file, cast to ``dtype``, equal ``param``'s."""
    flat = param.detach().reshape(-1)
    n = flat.numel()
    k = min(n, VERIFY_ELEMENTS)
    item = entry.dtype.itemsize
    for lo in dict.fromkeys((0, n - k)):
        got = torch.empty(k, dtype=entry.dtype)
        _pread(files.fd(str(entry.file)), got.view(torch.uint8), entry.start + lo * item)
        if not torch.equal(got.to(dtype), flat[lo : lo + k].to(dtype)):
            return False
    return True


def frozen_region(spec: LayerSpec, named: Mapping[str, torch.Tensor], dtype: torch.dtype,
                  files: FileHandles) -> ExternalRegion | None:
    """The frozen part of ``spec``'s flat layout (elements ``[train_numel, numel)``) as byte ranges
    of the checkpoint, or None when any frozen parameter of the layer fails a check (module
    documentation) or is stored quantized."""
    extents, covered = [], []
    for p in spec.params:
        if p.trainable:
            continue
        param = named[p.name]
        entry = stored_entry(param)
        if (p.packed is not None or entry is None or entry.nbytes != p.numel * entry.dtype.itemsize
                or param.device.type != "cpu"):
            return None
        if not _sample_matches(param, entry, dtype, files):
            return None
        dest = p.offset - spec.train_numel
        extents.append(Extent(str(entry.file), entry.start, entry.dtype, dest, p.numel))
        covered.append((dest, dest + p.numel))
    numel = spec.frozen_numel
    if not extents or numel <= 0:
        return None
    gaps, at = [], 0
    for lo, hi in sorted(covered):
        if lo > at:
            gaps.append((at, lo))
        at = max(at, hi)
    if at < numel:
        gaps.append((at, numel))
    return ExternalRegion(tuple(extents), numel, dtype, tuple(gaps))
