"""Pinning falls back to pageable memory when the driver refuses to register (one warning, no crash)."""

from __future__ import annotations

import pytest
import torch

from tinypipe.devices.backend import HostPinner


class _Runtime:
    """Stands in for torch.cuda.cudart(): registers ``allow`` buffers, then refuses (error 2)."""

    def __init__(self, allow: int) -> None:
        self.allow = allow
        self.registered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        if len(self.registered) >= self.allow:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append(ptr)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.registered.remove(ptr)
        return 0


def test_refused_registration_continues_pageable(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _Runtime(allow=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    pinner = HostPinner(enabled=True)
    bufs = [torch.empty(1024) for _ in range(4)]
    pinner.pin(bufs[0])
    pinner.pin(bufs[1])
    with pytest.warns(RuntimeWarning, match="continuing with pageable host memory"):
        pinner.pin(bufs[2])
    pinner.pin(bufs[3])  # no second warning, no attempt
    assert len(rt.registered) == 2 and pinner.bytes == 2 * 4096 and "error 2" in pinner.failed
    pinner.release()  # what was registered is unregistered
    assert rt.registered == [] and pinner.bytes == 0


def test_a_refusal_resets_the_cuda_error_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed cudaHostRegister leaves the CUDA runtime's last error set, which torch would report
    at its next kernel launch as that kernel's failure (an H100 run: an optimizer's ``zero_()``
    raised "already mapped"); the pinner resets it when it falls back to pageable memory."""
    import tinypipe.devices.backend as backend

    rt = _Runtime(allow=0)
    resets: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(backend, "clear_cuda_error", lambda: resets.append(1) or True)
    pinner = HostPinner(enabled=True)
    with pytest.warns(RuntimeWarning, match="continuing with pageable host memory"):
        pinner.pin(torch.empty(1024))
    assert resets == [1]


def test_a_pinner_never_released_unregisters_before_its_buffers_are_freed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine dropped without close(): its pinner's registrations are undone when it is
    collected, while the buffers still exist -- memory freed while registered leaves the range
    registered, and the next buffer placed there fails to register (seen in the GPU test run)."""
    import gc
    import weakref

    rt = _Runtime(allow=8)
    alive_at_unregister: list[bool] = []
    buf = torch.empty(1024)
    alive = weakref.ref(buf)

    def unregister(ptr: int) -> int:
        alive_at_unregister.append(alive() is not None)
        rt.registered.remove(ptr)
        return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(rt, "cudaHostUnregister", unregister)
    pinner = HostPinner(enabled=True)
    pinner.pin(buf)
    del buf
    assert rt.registered and alive() is not None  # the pinner keeps its buffers
    del pinner
    gc.collect()
    assert rt.registered == [] and alive_at_unregister == [True] and alive() is None
