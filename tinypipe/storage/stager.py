"""Read-ahead and write-back of one layer's SSD-resident state through the staging pool.

The optimizer path's pattern, in one place so that its two hazards are handled once:

- **Deadlock**: a layer takes all its slots at once (``StagingPool.acquire(n)`` is all-or-nothing
  and first come first served), so two layers in flight can never each hold part of what the
  other needs. Read-ahead depth is bounded by the pool: ``stage()`` blocks while the pool is
  exhausted, which is exactly the back-pressure the schedule wants.
- **Reuse before landing**: a slot goes back to the pool only when the write-back from it has
  completed (a done-callback, no thread waits for it), so the next layer's read can never
  overwrite bytes still being written. Hence size the pool for ``depth + 1`` layers: ``depth``
  read ahead plus the one whose write-back is landing. With only ``depth``, staging the next
  layer waits for the previous write-back, which then no longer overlaps the step.

Usage (one layer)::

    staged = stager.stage([(l, "master"), (l, "exp_avg"), (l, "exp_avg_sq")], check=abort.check)
    ...                                   # later, in the optimizer lane
    slots = staged.wait(check=abort.check)
    master = slots[(l, "master")].view(torch.float32, n)   # step on the staging buffers
    ...
    staged.write_back()                   # async; slots return to the pool when written
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Sequence

from tinypipe.errors import StorageError
from tinypipe.storage.staging import StagingPool, StagingSlot
from tinypipe.storage.store import IoHandle, SsdStateStore


class StagedLayer:
    """Slots holding (or about to hold) some regions' state; see :class:`StateStager`."""

    def __init__(self, store: SsdStateStore, pool: StagingPool, slots: dict[Hashable, StagingSlot],
                 reads: list[IoHandle]) -> None:
        self._store, self._pool = store, pool
        self.slots = slots
        self.reads = reads
        self._released = False

    def wait(self, check: Callable[[], None] | None = None) -> dict[Hashable, StagingSlot]:
        """The slots, once every read into them landed (raises the first read's StorageError)."""
        self._store.wait(self.reads, check)
        return self.slots

    def write_back(self, keys: Iterable[Hashable] | None = None) -> list[IoHandle]:
        """Write ``keys`` (default: all) back from their slots, asynchronously; every slot of the
        layer returns to the pool once those writes are done (at once if there are none). A
        failed write leaves its region invalid (see SsdStateStore) and is raised by the handle."""
        if self._released:
            raise StorageError("staged state was already written back or released")
        self._store.wait(self.reads)  # never write from a slot whose read is still landing
        chosen = list(self.slots) if keys is None else list(keys)
        handles = [self._store.write_async(k, self.slots[k].data) for k in chosen]
        self._released = True
        if not handles:
            self._pool.release(list(self.slots.values()))
            return handles
        remaining = [len(handles)]
        slots = list(self.slots.values())
        lock = threading.Lock()  # the handles' callbacks may run in different workers at once

        def landed(_: IoHandle) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._pool.release(slots)

        for h in handles:
            h.add_done_callback(landed)
        return handles

    def release(self) -> None:
        """Give the slots back without writing (read-only state, or after an abort); waits for
        reads still landing in them first."""
        if self._released:
            return
        for h in self.reads:
            while not h.done():
                h._event.wait(0.05)
        self._released = True
        self._pool.release(list(self.slots.values()))


class StateStager:
    """Stages regions of ``store`` in slots of ``pool`` (every region must fit one slot)."""

    def __init__(self, store: SsdStateStore, pool: StagingPool) -> None:
        too_big = [k for k in store.regions() if store.region_bytes(k) > pool.slot_bytes]
        if too_big:
            k = too_big[0]
            raise ValueError(f"SSD region {k!r} ({store.region_bytes(k)} bytes) does not fit a "
                             f"{pool.slot_bytes}-byte staging slot")
        self.store, self.pool = store, pool

    def stage(self, keys: Sequence[Hashable], read: Iterable[Hashable] | None = None,
              check: Callable[[], None] | None = None) -> StagedLayer:
        """Take one slot per key (blocking while the pool is exhausted; ``check`` cancels) and
        start reading ``read`` (default: all keys) into them. Keys not read get a slot whose
        content is undefined: state the caller fills (a new gradient, zero moments at step 0)."""
        slots_list = self.pool.acquire(len(keys), check)
        slots = dict(zip(keys, slots_list))
        chosen = list(keys) if read is None else list(read)
        reads: list[IoHandle] = []
        try:
            for k in chosen:
                reads.append(self.store.read_async(k, slots[k].data))
        except BaseException:
            StagedLayer(self.store, self.pool, slots, reads).release()
            raise
        return StagedLayer(self.store, self.pool, slots, reads)
