"""Page-aligned host allocations.

Buffers that may be page-locked with cudaHostRegister must own whole pages: two registrations
touching the same page fail. Allocating with a page of slack and registering only the aligned,
page-rounded interior keeps every registered range disjoint. Here, beside the
:class:`~tinypipe.devices.backend.HostPinner` that registers them, because the model layer
(copy-free loading) and the memory layer (the host store, gradient pools) both allocate them.
"""

from __future__ import annotations

import torch

PAGE = 4096


def aligned_empty(numel: int, dtype: torch.dtype = torch.float32, zero: bool = False) -> torch.Tensor:
    """A 1-D host tensor of ``numel`` elements starting on a page boundary, owning whole pages."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = -(-max(numel, 1) * itemsize // PAGE) * PAGE
    raw = (torch.zeros if zero else torch.empty)(nbytes + PAGE, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % PAGE
    return raw[shift : shift + nbytes].view(dtype)[:numel]


def registrable(t: torch.Tensor) -> torch.Tensor:
    """The page-rounded byte range behind an :func:`aligned_empty` tensor (what gets pinned)."""
    nbytes = -(-t.numel() * t.element_size() // PAGE) * PAGE
    base = t.untyped_storage()
    start = t.data_ptr() - base.data_ptr()
    return torch.empty(0, dtype=torch.uint8).set_(base, start, (nbytes,))
