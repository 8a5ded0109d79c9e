"""A bounded pool of page-aligned host staging buffers for state that lives on the SSD.

A layer's SSD-resident state is read into staging slots ahead of its optimizer step (read-ahead:
several layers in flight), the step runs on the slots, and they go back to the pool once their
write-back completed. The pool is the only host memory the SSD tier adds besides the caller's
own buffers: its size (``nbytes``), not the model's, bounds it. One allocation, page-aligned
slots of whole pages, registered (pinned) once, so the same slots serve direct I/O and fast
host<->device copies.

``acquire(count)`` takes ``count`` slots at once, all or nothing, first come first served: a
layer that needs three slots (master, two moments) can neither deadlock against another holding
some of them nor be starved by single-slot requests overtaking it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from tinypipe.errors import StorageError
from tinypipe.devices.host_buffers import PAGE, aligned_empty, registrable

#: How often a blocked ``acquire`` runs its ``check`` callback (seconds).
POLL_S = 0.05


class Pinner(Protocol):
    """What pins a host range in place (``tinypipe.devices.backend.HostPinner`` is one)."""

    def pin(self, tensor: torch.Tensor) -> None: ...


@dataclass(frozen=True, eq=False)
class StagingSlot:
    """One slot: ``data`` is its whole page-rounded byte range."""

    index: int
    data: torch.Tensor

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the slot as ``dtype`` (starts on a page boundary)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * itemsize > self.data.numel():
            raise ValueError(f"{numel} x {dtype} does not fit a {self.data.numel()}-byte staging slot")
        return self.data[: numel * itemsize].view(dtype)


class StagingPool:
    """``slots`` buffers of ``slot_bytes`` (rounded up to whole pages), handed out and returned."""

    def __init__(self, slots: int, slot_bytes: int, pinner: Pinner | None = None) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a staging pool needs slots, slot_bytes >= 1, got {slots}, {slot_bytes}")
        self.slot_bytes = -(-slot_bytes // PAGE) * PAGE
        self._buffer = aligned_empty(slots * self.slot_bytes, torch.uint8)
        if pinner is not None:
            pinner.pin(registrable(self._buffer))
        self.slots = [StagingSlot(i, self._buffer[i * self.slot_bytes : (i + 1) * self.slot_bytes])
                      for i in range(slots)]
        self._free: collections.deque[StagingSlot] = collections.deque(self.slots)
        self._waiters: collections.deque[object] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False

    @property
    def nbytes(self) -> int:
        """Host bytes the pool holds (for the memory report)."""
        return len(self.slots) * self.slot_bytes

    @property
    def free(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, count: int = 1, check: Callable[[], None] | None = None,
                timeout: float | None = None) -> list[StagingSlot]:
        """Take ``count`` slots, blocking until they are free and earlier requests were served.

        ``check`` runs every :data:`POLL_S` while blocked (and on :meth:`interrupt`); whatever it
        raises cancels the request. ``timeout`` (seconds) raises StorageError when exceeded."""
        if not 1 <= count <= len(self.slots):
            raise ValueError(f"cannot take {count} of {len(self.slots)} staging slots")
        token = object()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._waiters.append(token)
            try:
                while self._waiters[0] is not token or len(self._free) < count:
                    if self._closed:
                        raise StorageError("the staging pool was closed while waiting for a slot")
                    if check is not None:
                        check()
                    if deadline is not None and time.monotonic() >= deadline:
                        raise StorageError(f"no staging slot became free within {timeout:.1f} s")
                    self._cond.wait(POLL_S)
                taken = [self._free.popleft() for _ in range(count)]
            finally:
                self._waiters.remove(token)
                self._cond.notify_all()  # the next waiter may now be first and satisfiable
            return taken

    def release(self, slots: StagingSlot | list[StagingSlot]) -> None:
        """Return slots (after any write from them completed)."""
        items = [slots] if isinstance(slots, StagingSlot) else slots
        with self._cond:
            for slot in items:
                if self.slots[slot.index] is not slot or slot in self._free:
                    raise ValueError(f"staging slot {slot.index} is not held from this pool")
                self._free.append(slot)
            self._cond.notify_all()

    @contextmanager
    def hold(self, count: int = 1, check: Callable[[], None] | None = None) -> Iterator[list[StagingSlot]]:
        """``with pool.hold(3) as (a, b, c):`` -- acquire, and release at the end of the block."""
        taken = self.acquire(count, check)
        try:
            yield taken
        finally:
            self.release(taken)

    def interrupt(self) -> None:
        """Wake blocked acquirers now so their ``check`` runs (e.g. right after an abort)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Fail every blocked and later ``acquire``; held slots stay valid until released."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
