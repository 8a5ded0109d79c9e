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
