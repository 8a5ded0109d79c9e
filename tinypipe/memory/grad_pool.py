"""A bounded pool of host buffers that gradient chunks land in on their way to the optimizer.

One pool per device (so downloads from one device can never starve another's and deadlock the
in-order optimizer). Its size, not model depth, bounds host gradient memory. Buffers are
page-aligned and registered (pinned) once for fast device-to-host copies.
"""

from __future__ import annotations

import queue
from typing import Protocol

import torch

from tinypipe.devices.backend import HostPinner
from tinypipe.devices.host_buffers import aligned_empty, registrable


class Cancellation(Protocol):
    """What a waiting :meth:`HostGradPool.acquire` polls: ``check()`` raises once the step has
    failed elsewhere (the runtime's ``Abort`` is one), so a lane never waits on a dead step."""

    def check(self) -> None: ...


#: Elements per gradient chunk: at least 64 Ki, at most 32 Mi (128 MiB fp32). Layers larger than a
#: chunk stream through the pool chunk by chunk, so pinned host memory stays bounded whatever the
#: layer width (a 70B block would otherwise pin 3.4 GB per buffer per device).
MIN_CHUNK = 1 << 16
MAX_CHUNK = 1 << 25


def chunk_numel(slot_numel: int) -> int:
    """Gradient chunk size for a model whose largest block layer has ``slot_numel`` elements."""
    return min(max(slot_numel, MIN_CHUNK), MAX_CHUNK)


def buffer_count(slot_numel: int, requested: int | None) -> int:
    """Pool buffers per device: as asked, or enough for two whole block layers in flight (at least
    3). Measured on a 3B model: a pool holding less than one layer (3 x 32 Mi-element chunks of a 100 M
    layer) made each download wait for the optimizer and cost 8% of throughput."""
    if requested is not None:
        return requested
    return max(3, -(-2 * slot_numel // chunk_numel(slot_numel)) + 1)


class HostGradPool:
    """``count`` fp32 buffers of ``chunk`` elements each, handed out and returned. A waiting
    :meth:`acquire` checks its :class:`Cancellation` every ``poll_s`` seconds (the runtime passes
    the interval its lanes poll at)."""

    def __init__(self, count: int, chunk: int, pinner: HostPinner, poll_s: float) -> None:
        self.chunk = chunk
        self.poll_s = poll_s
        self.buffers = [aligned_empty(chunk, torch.float32) for _ in range(count)]
        for b in self.buffers:
            pinner.pin(registrable(b))
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for b in self.buffers:
            self._free.put(b)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * 4 for b in self.buffers)

    def acquire(self, cancel: Cancellation) -> torch.Tensor:
        while True:
            try:
                return self._free.get(timeout=self.poll_s)
            except queue.Empty:
                cancel.check()

    def release(self, buf: torch.Tensor) -> None:
        self._free.put(buf)

    def reset(self) -> None:
        """Mark every buffer free. Only valid between steps (no lane holds a buffer then); makes
        an aborted step -- whose queued chunks were never consumed -- unable to strand buffers."""
        self._free = queue.Queue()
        for b in self.buffers:
            self._free.put(b)
