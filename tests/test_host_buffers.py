"""Page-aligned host buffers: large ones are mapped on their own and advised onto huge pages; both
kinds start on a page, own whole pages, and the registrable range never reaches past them."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch

from tinypipe.devices.host_buffers import (
    HUGE_PAGE,
    HUGE_PAGES_ENV,
    PAGE,
    aligned_empty,
    huge_pages_wanted,
    registrable,
)

LINUX_ADVICE = hasattr(mmap, "MADV_HUGEPAGE")


def _owns_whole_pages(t: torch.Tensor) -> None:
    r = registrable(t)
    assert t.data_ptr() % PAGE == 0 and r.data_ptr() == t.data_ptr()
    assert r.numel() % PAGE == 0 and r.numel() >= t.numel() * t.element_size()
    storage = t.untyped_storage()
    assert r.data_ptr() + r.numel() <= storage.data_ptr() + storage.nbytes()


@pytest.mark.parametrize("numel,dtype", [(1000, torch.float32), (HUGE_PAGE // 4 + 123, torch.float32),
                                         (3 * HUGE_PAGE + 7, torch.uint8), (HUGE_PAGE // 2 + 1, torch.bfloat16)])
def test_buffers_start_on_a_page_and_own_whole_pages(numel: int, dtype: torch.dtype) -> None:
    t = aligned_empty(numel, dtype, zero=True)
    assert t.numel() == numel and t.dtype == dtype and t.is_contiguous()
    assert torch.count_nonzero(t).item() == 0  # zero=True holds on both paths
    _owns_whole_pages(t)
    t.fill_(1)
    assert t.sum(dtype=torch.float64).item() == numel


@pytest.mark.skipif(not LINUX_ADVICE, reason="MADV_HUGEPAGE is Linux-only")
def test_a_large_buffer_is_its_own_mapping_and_outlives_every_python_name(monkeypatch) -> None:
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    assert huge_pages_wanted()
    t = aligned_empty(HUGE_PAGE, torch.float32)
    storage = t.untyped_storage()
    assert storage.nbytes() == HUGE_PAGE * 4  # exactly its pages: no slack page, a mapping of its own
    maps = Path("/proc/self/smaps").read_text() if Path("/proc/self/smaps").exists() else ""
    start = f"{storage.data_ptr():x}-"
    if maps:  # the kernel saw the advice: the mapping's flags carry "hg"
        block = maps[maps.index(start):] if start in maps else ""
        flags = next((ln for ln in block.splitlines() if ln.startswith("VmFlags:")), "")
        assert " hg" in flags, flags
    view = t[5:]
    del t, storage
    gc.collect()
    view.fill_(2.5)  # the mapping lives as long as a tensor uses it
    assert view.sum().item() == 2.5 * view.numel()


def test_huge_pages_off_keeps_torch_s_allocator(monkeypatch) -> None:
    monkeypatch.setenv(HUGE_PAGES_ENV, "off")
    assert not huge_pages_wanted()
    t = aligned_empty(HUGE_PAGE, torch.float32)
    assert t.untyped_storage().nbytes() == HUGE_PAGE * 4 + PAGE  # torch's, with its page of slack
    _owns_whole_pages(t)
