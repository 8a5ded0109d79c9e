"""Page-aligned host buffers: every one starts on a page and owns whole pages, and the registrable
range (what cudaHostRegister pins) never reaches past it -- two registrations sharing a page fail."""

from __future__ import annotations

import pytest
import torch

from tinypipe.devices.host_buffers import PAGE, aligned_empty, registrable


@pytest.mark.parametrize("numel,dtype", [(1000, torch.float32), ((2 << 20) // 4 + 123, torch.float32),
                                         (3 * (2 << 20) + 7, torch.uint8), ((1 << 20) + 1, torch.bfloat16)])
def test_buffers_start_on_a_page_and_own_whole_pages(numel: int, dtype: torch.dtype) -> None:
    t = aligned_empty(numel, dtype, zero=True)
    assert t.numel() == numel and t.dtype == dtype and t.is_contiguous()
    assert torch.count_nonzero(t).item() == 0
    r = registrable(t)
    assert t.data_ptr() % PAGE == 0 and r.data_ptr() == t.data_ptr()
    assert r.numel() % PAGE == 0 and r.numel() >= t.numel() * t.element_size()
    storage = t.untyped_storage()
    assert r.data_ptr() + r.numel() <= storage.data_ptr() + storage.nbytes()
    t.fill_(1)
    assert t.sum(dtype=torch.float64).item() == numel
