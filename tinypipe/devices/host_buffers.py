"""Page-aligned host allocations.

Buffers that may be page-locked with cudaHostRegister must own whole pages: two registrations
touching the same page fail. Allocating with a page of slack and registering only the aligned,
page-rounded interior keeps every registered range disjoint. Here, beside the
:class:`~tinypipe.devices.backend.HostPinner` that registers them, because the model layer
(copy-free loading) and the memory layer (the host store, gradient pools) both allocate them.
Large buffers get a mapping of their own advised onto huge pages (:func:`aligned_empty`).
"""

from __future__ import annotations

import mmap
import os

import torch

PAGE = 4096
#: Buffers at least this large are mapped on their own and advised onto 2 MiB pages.
HUGE_PAGE = 2 << 20
#: ``TINYPIPE_HUGE_PAGES=off`` keeps every buffer on torch's allocator (to compare, or where a
#: kernel's compaction for huge pages costs more than it saves).
HUGE_PAGES_ENV = "TINYPIPE_HUGE_PAGES"


def huge_pages_wanted() -> bool:
    """Whether large buffers are advised onto huge pages: Linux (``MADV_HUGEPAGE``) unless
    :data:`HUGE_PAGES_ENV` says ``off``."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get(HUGE_PAGES_ENV, "on").lower() not in ("off", "0")


def _huge_mapped(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed anonymous memory advised onto huge pages, as a uint8 tensor that keeps
    the mapping alive (``torch.frombuffer`` holds a reference to it).

    Why: the host AdamW streams ~28 B/param through these buffers every step, and with the kernel's
    usual ``madvise`` THP mode torch's allocator gets 4 KiB pages only -- a TLB miss every 4 KiB.
    The fused CPU AdamW ran 1.1-1.7x faster on advised pages on the CI box
    (``bench/host_pages.py``); the GPU box's numbers are in bench/RESULTS.md (session 13)."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8)


def aligned_empty(numel: int, dtype: torch.dtype = torch.float32, zero: bool = False) -> torch.Tensor:
    """A 1-D host tensor of ``numel`` elements starting on a page boundary, owning whole pages
    (at least :data:`HUGE_PAGE` bytes: a mapping of its own, advised onto huge pages, zeroed)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = -(-max(numel, 1) * itemsize // PAGE) * PAGE
    if nbytes >= HUGE_PAGE and huge_pages_wanted():  # mmap starts on a page and hands out zeroes
        return _huge_mapped(nbytes).view(dtype)[:numel]
    raw = (torch.zeros if zero else torch.empty)(nbytes + PAGE, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % PAGE
    return raw[shift : shift + nbytes].view(dtype)[:numel]


def registrable(t: torch.Tensor) -> torch.Tensor:
    """The page-rounded byte range behind an :func:`aligned_empty` tensor (what gets pinned)."""
    nbytes = -(-t.numel() * t.element_size() // PAGE) * PAGE
    base = t.untyped_storage()
    start = t.data_ptr() - base.data_ptr()
    return torch.empty(0, dtype=torch.uint8).set_(base, start, (nbytes,))
