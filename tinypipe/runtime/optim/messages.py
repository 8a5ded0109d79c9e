"""What a layer's download task tells its update task, in order: the gradient norm, the chunks,
the end.

The norm comes first so the update can decide (step, defer, skip, or leave it to the device)
before any chunk lands; chunks then stream through the device's bounded host gradient pool, so
the update steps each one while the rest are still on the link. One :class:`GradStream` per
layer per step.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

import torch

from tinypipe.devices.backend import Backend
from tinypipe.memory.grad_pool import HostGradPool
from tinypipe.runtime.signals import POLL_S, Abort


@dataclass(frozen=True, slots=True)
class GradNorm:
    """The layer's gradient norm: an fp64 scalar on its device, valid once ``event`` completed."""

    norm: torch.Tensor
    event: object
    backend: Backend


@dataclass(frozen=True, slots=True)
class GradChunk:
    """Elements ``lo:hi`` of the layer's fp32 gradient, on the host once ``event`` completed: in
    ``buffer`` (from ``pool``, to be released) or, when ``buffer`` is None, already in the layer's
    retained gradient buffer."""

    lo: int
    hi: int
    buffer: torch.Tensor | None
    event: object
    backend: Backend
    pool: HostGradPool


@dataclass(frozen=True, slots=True)
class GradEnd:
    """No more chunks for this layer (a layer stepped on its device sends none)."""


GradMessage = GradNorm | GradChunk | GradEnd


class GradStream:
    """One layer's messages from its download to its update (unbounded: the pool bounds chunks)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[GradMessage] = queue.Queue()

    def put(self, message: GradMessage) -> None:
        self._queue.put(message)

    def get(self, abort: Abort) -> GradMessage:
        """The next message (polling ``abort`` while none is there)."""
        while True:
            try:
                return self._queue.get(timeout=POLL_S)
            except queue.Empty:
                abort.check()

    def drain(self) -> None:
        """Return the pool buffers of chunks an aborted update never consumed."""
        while not self._queue.empty():
            message = self._queue.get_nowait()
            if isinstance(message, GradChunk) and message.buffer is not None:
                message.pool.release(message.buffer)
