"""The optimizer path's SSD side: state that lives on the SSD, staged in DRAM around its uses.

Per step (:meth:`SsdTier.begin_step`) two stager threads walk the schedule's staging order
(:mod:`tinypipe.schedule.staging`): one reads what each upload needs (master, frozen weights)
into the upload pool, after the layer's leftover update of the last step (which rewrites its
master); the other reads each host-stepped layer's optimizer state into the update pool in the
order the gradients arrive, after all leftover work (that work uses the same pool). A stager
blocks while its pool is full: the back-pressure that bounds read-ahead and DRAM. The tasks take
their sets (:meth:`upload_sources`, :meth:`grad_buffer`, :meth:`for_update`); the optimizer steps
on the staging buffers with the same ChunkedAdamW calls as in DRAM (same numbers, bit for bit),
and :meth:`finish_update` writes back what changed, asynchronously -- the slots return to the
pool once the write landed. The clipped step's leftover work and rollbacks stage their layers the
same way (:meth:`background`).

A write that fails (disk full, I/O error) is remembered and raised, one line, by the next stage,
step or synchronize: the region it left behind cannot be read, so nothing continues from it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from tinypipe.errors import StorageError
from tinypipe.memory.host_store import HostStore, LayerState
from tinypipe.runtime.signals import POLL_S, Abort, Aborted
from tinypipe.runtime.workers import LaneWorkers
from tinypipe.schedule.ids import Lane, TaskId
from tinypipe.schedule.plan import Plan
from tinypipe.schedule.staging import (
    DEFAULT_READ_AHEAD,
    UPDATE_NAMES,
    StageSet,
    StagingOrder,
    staging_order,
    staging_pools,
)
from tinypipe.schedule.tasks import Schedule
from tinypipe.storage import IoHandle, IoRecord, IoTotals, StagedLayer, StagingPool
from tinypipe.storage.staging import Pinner

#: Lanes (worker threads) of the two stagers.
UPLOAD_STAGER, UPDATE_STAGER = Lane(None, "ssd-stage-uploads"), Lane(None, "ssd-stage-updates")
Key = tuple[int, str]


@dataclass
class StagedState:
    """One layer's state for its update: the LayerState to step (staging slots where offloaded,
    the DRAM tensors elsewhere), its retained-gradient slot (None: in DRAM or not retained), and
    the staged sets (index in the update order, set) holding them."""

    state: LayerState
    grad: torch.Tensor | None
    sets: list[tuple[int, StagedLayer]]


@dataclass
class _Step:
    """One step's staging: the order, the sets as the stagers issue them, who finished them."""

    order: StagingOrder
    abort: Abort
    io0: IoTotals
    uploads: list[StagedLayer | None]
    upload_ready: list[threading.Event]
    updates: list[StagedLayer | None]
    update_ready: list[threading.Event]
    stagers: list[threading.Event] = field(default_factory=list)
    done_uploads: set[int] = field(default_factory=set)
    done_updates: set[int] = field(default_factory=set)


class SsdTier:
    """Staging pools and per-step stagers for ``store``'s offloaded state under ``plan``."""

    def __init__(self, store: HostStore, plan: Plan, tied: bool, pinner: Pinner | None = None,
                 read_ahead: int = DEFAULT_READ_AHEAD) -> None:
        if store.offload is None:
            raise ValueError("an SSD tier needs a host store with offloaded state")
        self.host, self.off = store, store.offload
        self.regions = {layer: tuple(self.off.names(layer)) for layer in range(len(store.layers))
                        if self.off.names(layer)}
        self.read_ahead = read_ahead
        shape = staging_pools(plan, tied, {k: self.off.nbytes(k) for k in self.off.regions}, read_ahead)
        self.upload_pool = StagingPool(shape.upload_slots, shape.upload_slot_bytes, pinner) if (
            shape.upload_slots) else None
        self.update_pool = StagingPool(shape.update_slots, shape.update_slot_bytes, pinner) if (
            shape.update_slots) else None
        self._orders: dict[int, StagingOrder] = {}
        self._step: _Step | None = None
        self._lock = threading.Lock()
        self._writes: list[IoHandle] = []
        self._write_error: StorageError | None = None
        self.last_io = IoTotals()  # the last step's SSD traffic
        self.records: list[IoRecord] = []  # the last step's completed requests (trace lanes)

    def _bg_names(self, layer: int) -> list[str]:
        return [n for n in UPDATE_NAMES if n in self.regions.get(layer, ())]

    @property
    def nbytes(self) -> int:
        """Host bytes of the staging pools (and the store's bounce pages), for the memory report."""
        pools = sum(p.nbytes for p in (self.upload_pool, self.update_pool) if p is not None)
        return pools + self.off.ssd.host_bytes

    # ------------------------------------------------------------------ one step

    def order_for(self, schedule: Schedule) -> StagingOrder:
        if schedule.batch not in self._orders:
            self._orders[schedule.batch] = staging_order(schedule, self.regions)
        return self._orders[schedule.batch]

    def begin_step(self, schedule: Schedule, abort: Abort, workers: LaneWorkers,
                   wait_layer: Callable[[int, Abort], None],
                   wait_background: Callable[[Abort], None]) -> None:
        """Start the step's two stagers (``wait_layer``/``wait_background``: the last step's
        leftover work, which must land before this step reads what it writes)."""
        self.check()
        order = self.order_for(schedule)
        st = _Step(order, abort, self.off.ssd.stats.totals(),
                   [None] * len(order.uploads), [threading.Event() for _ in order.uploads],
                   [None] * len(order.updates), [threading.Event() for _ in order.updates])
        self._step = st

        def before_upload(s: StageSet) -> None:
            if "master" in s.names:
                wait_layer(s.layer, abort)

        first = [True]

        def before_update(s: StageSet) -> None:
            if first[0]:
                wait_background(abort)
                first[0] = False

        if order.uploads:
            st.stagers.append(workers.submit(UPLOAD_STAGER, lambda: self._stage_all(
                st, order.uploads, st.uploads, st.upload_ready, self.upload_pool, before_upload,
                UPLOAD_STAGER)))
        if order.updates:
            st.stagers.append(workers.submit(UPDATE_STAGER, lambda: self._stage_all(
                st, order.updates, st.updates, st.update_ready, self.update_pool, before_update,
                UPDATE_STAGER)))

    def _stage_all(self, st: _Step, sets: tuple[StageSet, ...], staged: list[StagedLayer | None],
                   ready: list[threading.Event], pool: StagingPool | None, before: Callable[[StageSet], None],
                   lane: Lane) -> None:
        """A stager: issue ``sets`` in order (blocking while the pool is full)."""
        assert pool is not None
        try:
            for i, s in enumerate(sets):
                before(s)
                keys = [(s.layer, n) for n in s.names]
                # the download fills the gradient slot; never-written moments are zeroed by step 1
                reads = [k for k in keys if k[1] != "grad" and self.off.written(k)]
                staged[i] = self._stage(pool, keys, reads, self._checker(st.abort))
                ready[i].set()
        except Aborted:
            return
        except BaseException as exc:  # noqa: BLE001 - surfaced as the step's failure
            st.abort.fail(str(lane), exc)

    def _stage(self, pool: StagingPool, keys: list[Key], reads: list[Key],
               check: Callable[[], None]) -> StagedLayer:
        """Take a slot per key (all at once) and start reading ``reads`` into theirs."""
        self.check()  # a failed write-back first, in its own words (a read of its region fails later)
        slots = dict(zip(keys, pool.acquire(len(keys), check)))
        handles: list[IoHandle] = []
        try:
            for k in reads:
                handles.append(self.off.ssd.read_async(k, slots[k].data))
        except BaseException:
            StagedLayer(self.off.ssd, pool, slots, handles).release()
            raise
        return StagedLayer(self.off.ssd, pool, slots, handles)

    def _checker(self, abort: Abort | None) -> Callable[[], None]:
        def check() -> None:
            if abort is not None:
                abort.check()
            self.check()
        return check

    def _take(self, st: _Step, ready: list[threading.Event], staged: list[StagedLayer | None], i: int,
              reads: bool = True) -> StagedLayer:
        """Set ``i`` once issued (and, with ``reads``, once its reads landed)."""
        check = self._checker(st.abort)
        while not ready[i].wait(POLL_S):
            check()
        sl = staged[i]
        assert sl is not None
        if reads:
            sl.wait(check)
        return sl

    def _view(self, sl: StagedLayer, layer: int, name: str) -> torch.Tensor:
        key = (layer, name)
        return sl.slots[key].view(self.off.dtype(key), self.off.numel(key))

    def _current(self) -> _Step:
        if self._step is None:
            raise RuntimeError("no SSD staging in progress (begin_step first)")
        return self._step

    # ------------------------------------------------------------------ the tasks' side

    def upload_sources(self, task_id: TaskId, layer: int, master: torch.Tensor, frozen: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None, StagedLayer | None]:
        """What upload ``task_id`` copies: staged views for what lives on the SSD, ``master`` /
        ``frozen`` (the DRAM tensors) otherwise, and the set to release after the copy."""
        st = self._current()
        m = st.order.master_of.get(layer)
        if m is not None and st.order.updates[m].first == task_id:  # the backward upload: kept for the update
            master = self._view(self._take(st, st.update_ready, st.updates, m), layer, "master")
        i = st.order.upload_of.get(task_id)
        if i is None:
            return master, frozen, None
        sl = self._take(st, st.upload_ready, st.uploads, i)
        names = st.order.uploads[i].names
        if "master" in names:
            master = self._view(sl, layer, "master")
        if "frozen" in names:
            frozen = self._view(sl, layer, "frozen")
        return master, frozen, sl

    def sources_outside_step(self, layer: int, master: torch.Tensor, frozen: torch.Tensor | None,
                             abort: Abort | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None, StagedLayer | None]:
        """:meth:`upload_sources` for an upload no step schedules (an evaluation): ``layer``'s
        offloaded master and frozen weights read into upload-pool slots, once landed (release the
        set after the copy); the DRAM tensors for what is not offloaded."""
        names = [n for n in ("master", "frozen") if self.off.has(layer, n)]
        if not names:
            return master, frozen, None
        if self._step is not None or self.upload_pool is None:
            raise RuntimeError("an upload outside a step needs the upload pool free (no step staging)")
        keys = [(layer, n) for n in names]
        sl = self._stage(self.upload_pool, keys, keys, self._checker(abort))
        sl.wait(self._checker(abort))
        if "master" in names:
            master = self._view(sl, layer, "master")
        if "frozen" in names:
            frozen = self._view(sl, layer, "frozen")
        return master, frozen, sl

    def uploaded(self, task_id: TaskId, sl: StagedLayer) -> None:
        """The upload's copies out of ``sl`` are complete: its slots go back to the pool."""
        st = self._current()
        sl.release()
        st.done_uploads.add(st.order.upload_of[task_id])

    def stages_update(self, layer: int) -> bool:
        st = self._step
        return st is not None and (layer in st.order.state_of or layer in st.order.master_of)

    def grad_buffer(self, layer: int) -> torch.Tensor | None:
        """The staging slot ``layer``'s download writes its retained gradient into (None: the
        gradient is not on the SSD)."""
        st = self._current()
        i = st.order.state_of.get(layer)
        if i is None or "grad" not in st.order.updates[i].names:
            return None
        return self._view(self._take(st, st.update_ready, st.updates, i, reads=False), layer, "grad")

    def for_update(self, layer: int) -> StagedState | None:
        """``layer``'s state for its optimizer step, once its reads landed (None: nothing of it is
        on the SSD)."""
        st = self._current()
        fields: dict[str, torch.Tensor] = {}
        grad = None
        sets = []
        for i in (st.order.master_of.get(layer), st.order.state_of.get(layer)):
            if i is None:
                continue
            sl = self._take(st, st.update_ready, st.updates, i)
            sets.append((i, sl))
            for name in st.order.updates[i].names:
                if name == "grad":
                    grad = self._view(sl, layer, name)
                else:
                    fields[name] = self._view(sl, layer, name)
        if not sets:
            return None
        return StagedState(replace(self.host.layers[layer], **fields), grad, sets)

    def finish_update(self, layer: int, staged: StagedState, decision: str) -> None:
        """Write back what ``decision`` changed ("step": everything staged; "defer": the gradient
        the end of the step needs; "skip": nothing), asynchronously; the slots follow."""
        st = self._current()
        for i, sl in staged.sets:
            names = st.order.updates[i].names
            if decision == "step":
                chosen = list(names)
            else:
                chosen = ["grad"] if decision == "defer" and "grad" in names else []
            keys = [(layer, n) for n in chosen]
            self._track(sl.write_back(keys))
            self.off.mark_written(keys)
            st.done_updates.add(i)

    def end_step(self) -> None:
        """After every task ran: the stagers are done, every set was given back; the step's SSD
        traffic is in :attr:`last_io` and :attr:`records`. Raises a failed write."""
        st = self._current()
        for e in st.stagers:
            e.wait()
        self._step = None
        leftover = [i for i in range(len(st.uploads)) if i not in st.done_uploads]
        leftover_upd = [i for i in range(len(st.updates)) if i not in st.done_updates]
        self._release(st, leftover, leftover_upd)
        if leftover or leftover_upd:
            raise RuntimeError(f"SSD staging: sets never used this step (uploads {leftover}, updates "
                               f"{leftover_upd})")
        self._account(st)
        with self._lock:
            self._writes = [h for h in self._writes if not h.done()]
        self.check()

    def abandon_step(self, synchronize: Callable[[], None]) -> None:
        """After a failed step: wait for the stagers to stop, let the devices finish any copy
        out of a slot (``synchronize``), then give every set still held back."""
        st = self._step
        if st is None:
            return
        self._step = None
        for e in st.stagers:
            e.wait(5.0)
        synchronize()
        self._release(st, [i for i in range(len(st.uploads)) if i not in st.done_uploads],
                      [i for i in range(len(st.updates)) if i not in st.done_updates])
        self._account(st)

    def _release(self, st: _Step, uploads: list[int], updates: list[int]) -> None:
        for staged, idx in ((st.uploads, uploads), (st.updates, updates)):
            for i in idx:
                sl = staged[i]
                if sl is not None:
                    sl.release()

    def _account(self, st: _Step) -> None:
        self.last_io = self.off.ssd.stats.totals() - st.io0
        self.records = self.off.ssd.stats.take_records()

    # ------------------------------------------------------------------ the leftover work

    def background(self, work: list[tuple[int, Callable[[], None]]],
                   views: dict[int, tuple[LayerState, torch.Tensor | None]]
                   ) -> list[tuple[int, Callable[[], None]]]:
        """``work`` ((layer, fn) in order), each layer's offloaded state staged around its fn:
        read ahead (one layer, when the pool holds two), handed to fn through ``views`` (the
        decisions' staged states), written back after (master and moments; the gradient is
        spent). Layers with nothing on the SSD run as they are."""
        staged_layers = [layer for layer, _ in work if self._bg_names(layer)]
        if not staged_layers:
            return work
        runner = _BackgroundStaging(self, staged_layers, views)
        return [(layer, runner.wrap(layer, fn) if layer in runner.index else fn) for layer, fn in work]

    # ------------------------------------------------------------------ writes

    def _track(self, handles: list[IoHandle]) -> None:
        for h in handles:
            h.add_done_callback(self._landed)
        with self._lock:
            self._writes.extend(handles)

    def _landed(self, handle: IoHandle) -> None:
        if handle.error is not None and self._write_error is None:
            self._write_error = handle.error

    def check(self) -> None:
        """Raise the first failed write-back (StorageError, one line)."""
        if self._write_error is not None:
            raise self._write_error

    def flush(self) -> None:
        """Wait for every write-back issued; raise the first failure."""
        with self._lock:
            writes, self._writes = self._writes, []
        try:
            self.off.ssd.wait(writes)
        finally:
            self.check()

    def close(self) -> None:
        """Fail blocked stagers (their pools are closed); the store itself is the host store's."""
        for pool in (self.upload_pool, self.update_pool):
            if pool is not None:
                pool.close()


class _BackgroundStaging:
    """The background lane's staging of its layers, in work order, with one layer read ahead."""

    def __init__(self, tier: SsdTier, layers: list[int],
                 views: dict[int, tuple[LayerState, torch.Tensor | None]]) -> None:
        self.tier, self.layers, self.views = tier, layers, views
        self.index = {layer: k for k, layer in enumerate(layers)}
        pool = tier.update_pool
        assert pool is not None
        biggest = max(len(tier._bg_names(layer)) for layer in layers)
        self.ahead = 1 if len(pool.slots) >= 2 * biggest else 0
        self.staged: dict[int, StagedLayer] = {}
        self.issued = 0

    def _issue_through(self, k: int) -> None:
        tier = self.tier
        while self.issued < len(self.layers) and self.issued <= k + self.ahead:
            layer = self.layers[self.issued]
            keys = [(layer, n) for n in tier._bg_names(layer)]
            reads = [key for key in keys if tier.off.written(key)]
            pool = tier.update_pool
            assert pool is not None
            self.staged[layer] = tier._stage(pool, keys, reads, tier._checker(None))
            self.issued += 1

    def wrap(self, layer: int, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            tier = self.tier
            try:
                self._issue_through(self.index[layer])
                sl = self.staged.pop(layer)
                sl.wait(tier._checker(None))
                fields, grad = {}, None
                for name in tier._bg_names(layer):
                    view = tier._view(sl, layer, name)
                    if name == "grad":
                        grad = view
                    else:
                        fields[name] = view
                self.views[layer] = (replace(tier.host.layers[layer], **fields), grad)
                try:
                    fn()
                finally:
                    self.views.pop(layer, None)
                keys = [(layer, n) for n in tier._bg_names(layer) if n != "grad"]
                tier._track(sl.write_back(keys))
                tier.off.mark_written(keys)
            except BaseException:
                for held in self.staged.values():
                    held.release()
                self.staged.clear()
                raise
        return run
