"""Host-stashed pack inputs in the offload directory's files (``Plan.stash_on_ssd``): at long
sequences, when host memory cannot hold every ``[B, S, H]`` stash, the planner puts some boundaries'
stashes on the SSD (:mod:`tinypipe.planner.spill`).

Each such boundary keeps one region per batch row (one sequence) in an :class:`SsdStateStore` of
its own under ``Config.offload_dir`` (direct I/O, striped over several directories, the store's
worker threads: the optimizer state's storage layer), and a small pool of page-aligned, registered
staging slots (:class:`~tinypipe.storage.staging.StagingPool`, :mod:`tinypipe.storage.stash_layout`
sizes it) replaces the boundary's ``[B, S, H]`` host buffer:

- **write** (the previous pack's forward; the boundary's gradient, written into the same rows by
  the pack's backward where ``host_gradient_boundaries`` says so -- its rows are dead once that
  backward read them): the rows go from the device into a slot (on CUDA on the ``stash_out`` side
  stream), and one I/O thread, after the copy's event, issues one write per row; the slot returns
  to the pool when the writes land.
- **read** (the pack's forward, its backward, the previous pack's backward for the gradient): the
  same I/O thread issues one read per row into a slot -- ahead of need where the schedule reads the
  next micro-batch ahead (:meth:`tinypipe.runtime.stash_io.StashIO.read_ahead_next`) -- and the
  reader copies the rows up (on CUDA on the ``stash_in`` side stream, the compute stream waiting
  for it) and hands the slot back once the copy is done.

Ordering: the store runs the requests on one region in the order they were issued, and every
request is issued by the one I/O thread in the order the lanes asked for it; a reader asks only
after the task that wrote its rows has run (the step's signals), so it reads what that task wrote.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence

import torch

from tinypipe.devices.backend import HostPinner
from tinypipe.runtime.buffers import RowBuffer
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.schedule.plan import Plan
from tinypipe.storage import stash_layout
from tinypipe.storage.staging import StagingPool, StagingSlot
from tinypipe.storage.store import IoHandle, SsdStateStore


class SsdStash:
    """The SSD boundaries' store, staging pool and I/O thread, kept while the batch shape stays."""

    def __init__(self, pinner: HostPinner, directory: str | Sequence[str] | None) -> None:
        self._pinner = pinner
        self._directory = directory
        self._key: tuple | None = None
        self.store: SsdStateStore | None = None
        self.pool: StagingPool | None = None
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ssd-stash")
        self._rows: dict[int, SsdRows] = {}
        self.read_bytes = 0  # bytes read back / written since the engine started (tests, metrics)
        self.write_bytes = 0
        self._mark = (0, 0)  # the counters when this step began (prepare)
        self.failure: BaseException | None = None  # a write that could not be issued (raised on)
        self._lock = threading.Lock()
        #: test hook: maps (boundary, row) to the region a read really reads (sabotage tests)
        self.read_region: Callable[[int, int], tuple[int, int]] = lambda q, r: (q, r)

    def prepare(self, plan: Plan, batch: int, seq: int, hidden: int, dtype: torch.dtype) -> None:
        """The store's regions and the staging pool for this batch shape (nothing without SSD
        boundaries)."""
        self._mark = (self.read_bytes, self.write_bytes)
        if not plan.stash_on_ssd:
            return
        if self._directory is None:
            raise RuntimeError("the plan stashes pack inputs on the SSD (stash_on_ssd) but no offload "
                               "directory is set: give Config(offload_dir=...) / --offload-dir DIR")
        itemsize = torch.empty((), dtype=dtype).element_size()
        key = (plan.stash_on_ssd, batch, seq, hidden, dtype,
               stash_layout.slot_rows(plan.micro_batch_size, plan.backward_micro_batch_size, batch))
        if key == self._key:
            return
        self.close_store()
        row = stash_layout.row_bytes(seq, hidden, itemsize)
        regions = {(q, r): seq * hidden * itemsize for q in plan.stash_on_ssd for r in range(batch)}
        dirs = self._directory
        self.store = SsdStateStore(list(dirs) if isinstance(dirs, (list, tuple)) else dirs, regions)
        self.pool = StagingPool(stash_layout.STASH_SLOTS, key[-1] * row, self._pinner)
        self._rows = {q: SsdRows(self, q, (batch, seq, hidden), dtype, row) for q in plan.stash_on_ssd}
        self._key = key

    def step_bytes(self) -> tuple[int, int]:
        """(read, written) bytes since this step's :meth:`prepare`."""
        return self.read_bytes - self._mark[0], self.write_bytes - self._mark[1]

    def rows(self, q: int) -> SsdRows:
        return self._rows[q]

    @property
    def nbytes(self) -> int:
        """Host bytes: the staging pool and the store's bounce pages."""
        if self.pool is None or self.store is None:
            return 0
        return self.pool.nbytes + self.store.host_bytes

    def end_step(self, failed: bool = False) -> None:
        """Hand back slots of read-aheads nobody consumed (an aborted step) and wait for the I/O
        thread's queue (the next step's writes go after this step's reads)."""
        self._io.submit(lambda: None).result()
        for rows in self._rows.values():
            rows.drop_ahead()
        if failed:  # the step's own error is the one to raise; the rows are rewritten next step
            self.failure = None
        self.raise_failure()

    def close_store(self) -> None:
        for rows in self._rows.values():
            rows.drop_ahead()
        self._rows = {}
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.store is not None:
            self.store.close()
            self.store = None
        self._key = None

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self.close_store()

    def _submit_write(self, issue: Callable[[], list[IoHandle]]) -> None:
        """Queue a write's issue on the I/O thread; a failure to issue it (never a silent skip: the
        region would still hold the last step's rows) is raised by the next read or :meth:`end_step`."""
        def run() -> list[IoHandle]:
            try:
                return issue()
            except BaseException as e:
                self.failure = self.failure or e
                raise
        self._io.submit(run)

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"an SSD stash write could not be issued: {self.failure}") from self.failure

    def _count(self, op: str, nbytes: int) -> None:
        with self._lock:
            if op == "read":
                self.read_bytes += nbytes
            else:
                self.write_bytes += nbytes


class _Pending:
    """A slot whose row requests the I/O thread issues (``future`` resolves to their handles)."""

    def __init__(self, slot: StagingSlot, future: concurrent.futures.Future) -> None:
        self.slot = slot
        self.future = future

    def wait(self, check: Callable[[], None] | None) -> None:
        handles: list[IoHandle] = self.future.result()
        SsdStateStore.wait(handles, check)


class SsdRows(RowBuffer):
    """One SSD boundary's rows as a :class:`RowBuffer` (no tensor: the rows are in files)."""

    def __init__(self, stash: SsdStash, q: int, shape: tuple[int, ...], dtype: torch.dtype, row: int) -> None:
        super().__init__(shape, dtype, None)
        self.stash, self.q, self.row = stash, q, row
        self.row_numel = shape[1] * shape[2]
        # bytes of one row's elements (``row``: the same, rounded up to a page)
        self.row_data = self.row_numel * torch.empty((), dtype=dtype).element_size()
        self._ahead: dict[tuple[int, int], _Pending] = {}
        self._lock = threading.Lock()

    def _views(self, slot: StagingSlot, n: int) -> list[torch.Tensor]:
        return [slot.data[i * self.row: i * self.row + self.row_data].view(self.dtype).view(self.shape[1:])
                for i in range(n)]

    def _checker(self, check: Callable[[], None] | None) -> Callable[[], None]:
        """``check`` (the step's abort) and the stash's own failure, for a wait on a slot."""
        def both() -> None:
            if check is not None:
                check()
            self.stash.raise_failure()
        return both

    def _check_rows(self, lo: int, hi: int) -> None:
        pool = self.stash.pool
        assert pool is not None
        if not 0 <= lo < hi <= self.shape[0] or (hi - lo) * self.row > pool.slot_bytes:
            raise RuntimeError(f"SSD stash of boundary {self.q}: rows {lo}:{hi} do not fit a staging slot")

    # -- writes ------------------------------------------------------------------------------------
    def write_rows(self, lo: int, hi: int, src: torch.Tensor, dev: DeviceRuntime | None,
                   check: Callable[[], None] | None = None) -> None:
        """Rows ``lo:hi`` from ``src`` (on any device) to their regions, asynchronously."""
        self._check_rows(lo, hi)
        stash, pool = self.stash, self.stash.pool
        assert pool is not None and stash.store is not None
        slot = pool.acquire(1, self._checker(check))[0]
        views = self._views(slot, hi - lo)
        event = None
        if dev is not None and dev.backend.is_cuda and src.is_cuda:
            side = dev.streams["stash_out"]
            dev.backend.wait_event(side, dev.backend.record_event(dev.streams["compute"]))
            with dev.backend.use_stream(side):
                for i, v in enumerate(views):
                    v.copy_(src[i], non_blocking=True)
            src.record_stream(side)  # type: ignore[arg-type]
            event = dev.backend.record_event(side)
        else:
            for i, v in enumerate(views):
                v.copy_(src[i])
        store, q = stash.store, self.q
        backend = dev.backend if dev is not None else None

        def issue() -> list[IoHandle]:
            if event is not None and backend is not None:
                backend.sync_event(event)  # the rows are in the slot
            handles: list[IoHandle] = []
            try:
                for i, r in enumerate(range(lo, hi)):
                    handles.append(store.write_async((q, r), slot.data[i * self.row:]))
            except BaseException:
                if handles:  # the slot is free once the writes already out are done
                    SsdStateStore.wait(handles)
                pool.release(slot)
                raise
            left = [len(handles)]
            lock = threading.Lock()

            def landed(_: IoHandle) -> None:
                with lock:
                    left[0] -= 1
                    done = left[0] == 0
                if done:
                    pool.release(slot)

            for h in handles:
                h.add_done_callback(landed)
            stash._count("write", (hi - lo) * self.row_data)
            return handles

        stash._submit_write(issue)

    # RowBuffer's interface (the CPU path of StashIO.write_rows / the head's direct writes)
    def write(self, lo: int, hi: int, src: torch.Tensor) -> None:
        self.write_rows(lo, hi, src, None)

    # -- reads -------------------------------------------------------------------------------------
    def _issue_read(self, lo: int, hi: int, slot: StagingSlot) -> _Pending:
        stash = self.stash
        store = stash.store
        assert store is not None
        q = self.q

        def issue() -> list[IoHandle]:
            handles = []
            for i, r in enumerate(range(lo, hi)):
                key = stash.read_region(q, r)
                handles.append(store.read_async(key, slot.data[i * self.row:(i + 1) * self.row]))
            stash._count("read", (hi - lo) * self.row_data)
            return handles

        return _Pending(slot, stash._io.submit(issue))

    def prefetch(self, lo: int, hi: int) -> None:
        """Start reading rows ``lo:hi`` into a slot (their writer has run); skipped when the pool
        keeps fewer than two slots free (the writes and a direct read must never wait on it)."""
        pool = self.stash.pool
        assert pool is not None
        with self._lock:
            if (lo, hi) in self._ahead or pool.free < 3:
                return
            self._check_rows(lo, hi)
            slot = pool.acquire(1)[0]
            self._ahead[(lo, hi)] = self._issue_read(lo, hi, slot)

    def read_rows(self, lo: int, hi: int, dev: DeviceRuntime | None, device: torch.device,
                  check: Callable[[], None] | None = None) -> torch.Tensor:
        """Rows ``lo:hi`` on ``device``, a fresh tensor: the read-ahead, or a read now."""
        with self._lock:
            pending = self._ahead.pop((lo, hi), None)
        pool = self.stash.pool
        assert pool is not None
        if pending is None:
            self._check_rows(lo, hi)
            pending = self._issue_read(lo, hi, pool.acquire(1, self._checker(check))[0])
        try:
            pending.wait(check)
            self.stash.raise_failure()  # a write of these rows that never went out
        except BaseException:
            pool.release(pending.slot)
            raise
        views = self._views(pending.slot, hi - lo)
        out = torch.empty((hi - lo,) + tuple(self.shape[1:]), dtype=self.dtype, device=device)
        if dev is not None and dev.backend.is_cuda and out.is_cuda:
            side = dev.streams["stash_in"]
            dev.backend.wait_event(side, dev.backend.record_event(dev.streams["compute"]))
            with dev.backend.use_stream(side):
                for i, v in enumerate(views):
                    out[i].copy_(v, non_blocking=True)
            out.record_stream(side)  # type: ignore[arg-type]
            event = dev.backend.record_event(side)
            dev.backend.wait_event(dev.streams["compute"], event)
            slot = pending.slot

            backend = dev.backend

            def release() -> None:
                backend.sync_event(event)  # the copy up has read the slot
                pool.release(slot)

            self.stash._io.submit(release)
        else:
            for i, v in enumerate(views):
                out[i].copy_(v)
            pool.release(pending.slot)
        return out

    def read(self, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        return self.read_rows(lo, hi, None, device)

    def drop_ahead(self) -> None:
        """Release the slots of read-aheads nobody consumed."""
        with self._lock:
            left, self._ahead = list(self._ahead.values()), {}
        for p in left:
            try:
                p.wait(None)
            except Exception:  # an aborted step's request: its slot is free all the same
                pass
            if self.stash.pool is not None:
                self.stash.pool.release(p.slot)

    def free(self) -> None:  # the rows stay in their files (the gradient may reuse them)
        pass
