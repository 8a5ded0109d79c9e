"""Execute one schedule: a thread per lane, each running its tasks in order.

Lanes: per device ``compute``, ``h2d`` (uploads) and ``d2h`` (gradient downloads), plus one host
``optimizer`` lane. A task first waits for its dependencies' signals (the host only until the
producer has queued its work; the lane's stream then waits on the producer's event), runs, and
fires its own signal. Any exception aborts the step: every waiting lane notices within a poll
interval and the caller gets the first error with its lane and task.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from tinypipe.errors import WorkerError
from tinypipe.memory.host_store import HostStore
from tinypipe.runtime.buffers import RowBuffer
from tinypipe.runtime.deferred import DeferredUpdates
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.handlers import TaskHandlers
from tinypipe.runtime.stash_io import StashIO
from tinypipe.runtime.signals import Abort, Aborted, Signal
from tinypipe.runtime.updater import StepUpdater
from tinypipe.runtime.workers import LaneWorkers
from tinypipe.schedule.tasks import STREAMING_KINDS, Kind, Schedule, Task


ABORT_GRACE_S = 2.0  # after an abort, how long lanes get to notice before the step gives up on them


@dataclass
class StepInputs:
    """The global batch, already validated, on the host."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    shifted_labels: torch.Tensor  # labels[:, 1:] padded with -100: position t predicts this
    denom: int  # labelled tokens in the whole global batch

    @property
    def batch(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq(self) -> int:
        return int(self.input_ids.shape[1])


@dataclass
class TaskTiming:
    lane: str
    task: str
    host_start: float
    host_end: float
    events: tuple[object, object] | None = None


@dataclass
class StepState:
    """Buffers and accumulators alive for one step."""

    acts: list[RowBuffer]
    grads: list[RowBuffer]
    contexts: dict[int, list] = field(default_factory=dict)
    context_lock: threading.Lock = field(default_factory=threading.Lock)
    loss_sum: torch.Tensor | None = None
    layer_queues: dict[int, "queue.Queue"] = field(default_factory=dict)
    timings: list[TaskTiming] = field(default_factory=list)
    loss_value: float | None = None


class StepRunner(StashIO, TaskHandlers):
    """Runs ``schedule`` once over ``inputs`` with the engine's devices and host store."""

    def __init__(
        self,
        schedule: Schedule,
        inputs: StepInputs,
        devices: list[DeviceRuntime],
        store: HostStore,
        updater: StepUpdater,
        compute_dtype: torch.dtype,
        hidden_size: int,
        head_chunk_tokens: int,
        host_stash: dict[int, torch.Tensor],
        trace: bool,
        fault: Callable[[Task], None] | None = None,
        stall_timeout: float = 300.0,
        check_finite: bool = False,
        optimizer_threads: int | None = None,
        prefetch_pool: dict | None = None,
        workers: LaneWorkers | None = None,
        deferred: DeferredUpdates | None = None,
    ) -> None:
        self.s = schedule
        self.inp = inputs
        self.devices = devices
        self.store = store
        self.updater = updater
        self.dtype = compute_dtype
        self.head_chunk = head_chunk_tokens
        self.trace = trace
        self.fault = fault
        self.abort = Abort()
        self.signals = {tid: Signal() for tid in schedule.tasks}
        self._extra: dict[str, list[object]] = {}  # lane -> side streams the current task used
        self._prefetched: dict[tuple, tuple[torch.Tensor, object]] = {}
        self._current: dict[str, str] = {}
        self.stuck = ""  # lanes still inside a task when the step gave up on them
        self.stall_timeout = stall_timeout
        self.check_finite = check_finite
        self.optimizer_threads = optimizer_threads
        self._ring = prefetch_pool if prefetch_pool is not None else {}  # device -> [buffers, next index]
        self.workers = workers
        self.deferred = deferred if deferred is not None else DeferredUpdates()  # the last step's leftovers
        plan = schedule.plan
        B, S, Hd = inputs.batch, inputs.seq, hidden_size
        P = plan.num_packs
        shape = (B, S, Hd)

        def buffer(dev_index: int, on_host: bool, q: int, kind: str) -> RowBuffer:
            if on_host:
                key = (q if kind == "act" else -1 - q)
                host = host_stash.get(key)
                if host is None or host.shape != shape or host.dtype != compute_dtype:
                    raise RuntimeError(f"host stash for {kind} {q} not prepared")
                return RowBuffer(shape, compute_dtype, None, host=host)
            d = devices[dev_index]
            return RowBuffer(shape, compute_dtype, d.backend, d.streams["compute"])

        acts = []
        for q in range(P + 1):
            owner = plan.embed_device if q == 0 else (plan.fwd_device[q] if q < P else plan.head_device)
            acts.append(buffer(owner, q > 0 and plan.stash_on_host[q], q, "act"))
        grads = []
        for q in range(P + 1):
            owner = plan.embed_device if q == 0 else plan.bwd_device[q - 1]
            grads.append(buffer(owner, False, q, "grad"))
        self.state = StepState(acts=acts, grads=grads)
        self.state.layer_queues = {layer: queue.Queue() for layer in range(schedule.num_layers)}

    def run(self) -> StepState:
        own = self.workers is None  # without the engine's persistent workers: threads for this step only
        workers = LaneWorkers() if own else self.workers
        done = [workers.submit(lane, functools.partial(self._lane, lane, ids)) for lane, ids in self.s.lanes.items()]
        try:
            return self._supervise(done)
        finally:
            if own:
                workers.shutdown(timeout=0.0)

    def _supervise(self, done: list[threading.Event]) -> StepState:
        last_progress, last_count = time.monotonic(), 0
        aborted_at: float | None = None
        self.stuck = ""
        while not all(d.is_set() for d in done):
            for d in done:
                d.wait(timeout=0.1)
            now = time.monotonic()
            count = len(self.state.timings)
            if count != last_count:
                last_progress, last_count = now, count
            elif now - last_progress > self.stall_timeout and not self.abort.failed:
                self.abort.fail("watchdog", TimeoutError(
                    f"no task finished for {self.stall_timeout:.0f} s; waiting: {self._waiting()}"))
            if self.abort.failed:
                aborted_at = aborted_at or now
                if now - aborted_at > ABORT_GRACE_S:  # a lane stuck inside a task: give up on it
                    self.stuck = self._waiting()
                    break
        self._drain_queues()
        if self.abort.error is not None:
            err = self.abort.error
            raise WorkerError(f"{self.abort.where} failed: {type(err).__name__}: {err}") from err
        for d in self.devices:
            d.backend.synchronize()
        return self.state

    def _drain_queues(self) -> None:
        """Return gradient chunks an aborted update never consumed to their pools."""
        for q in self.state.layer_queues.values():
            while not q.empty():
                kind, payload, _, src = q.get_nowait()
                if kind == "chunk" and payload[2] is not None:  # None: downloaded into a retained buffer
                    src.grad_pool.release(payload[2])

    def _waiting(self) -> str:
        """Each lane's current task (for stall reports)."""
        return ", ".join(f"{lane}:{tid}" for lane, tid in sorted(self._current.items()) if tid)

    def _lane(self, lane: str, ids: list[str]) -> None:
        tid = ""
        if lane == "host:optimizer" and self.optimizer_threads:
            torch.set_num_threads(self.optimizer_threads)
        dev_index = int(lane[3:].split(":")[0]) if lane.startswith("dev") else -1
        if dev_index >= 0 and self.devices[dev_index].backend.is_cuda:
            torch.cuda.set_device(self.devices[dev_index].device)  # kernels of this lane default here
        try:
            for tid in ids:
                self._current[lane] = tid
                task = self.s.tasks[tid]
                dev = self.devices[task.device] if task.device >= 0 else None
                stream = dev.streams[lane.split(":")[1]] if dev is not None else None
                backend = dev.backend if dev is not None else None
                if task.kind not in STREAMING_KINDS:  # an UPDATE streams its download's chunks
                    for dep in task.deps:
                        self.signals[dep].wait(self.abort, backend, stream)
                start = time.perf_counter()
                ev0 = backend.record_event(stream, timing=True) if (self.trace and backend and backend.is_cuda) else None
                self._extra[lane] = []
                if dev is not None:
                    with dev.backend.use_stream(stream):
                        self._dispatch(task, dev)
                else:
                    self._dispatch(task, None)
                ev1 = backend.record_event(stream, timing=True) if ev0 is not None else None
                self.signals[tid].fire(backend, [stream] + self._extra[lane])
                self.state.timings.append(
                    TaskTiming(lane, tid, start, time.perf_counter(), (ev0, ev1) if ev0 is not None else None)
                )
        except Aborted:
            return
        except BaseException as exc:  # noqa: BLE001 - surfaced to the caller by run()
            self.abort.fail(f"{lane} task {tid}", exc)
        finally:
            self._current[lane] = ""

    def _dispatch(self, task: Task, dev: DeviceRuntime | None) -> None:
        if self.fault is not None:
            self.fault(task)
        handler = {
            Kind.RESIDENT_UPLOAD: self._upload,
            Kind.UPLOAD: self._upload,
            Kind.EMBED_FWD: self._embed_fwd,
            Kind.FWD: self._fwd,
            Kind.HEAD: self._head,
            Kind.BWD: self._bwd,
            Kind.EMBED_BWD: self._embed_bwd,
            Kind.DOWNLOAD: self._download,
            Kind.UPDATE: self._update,
        }[task.kind]
        handler(task, dev)


def host_times(timings: list[TaskTiming], origin: float) -> list[dict]:
    """Timings as trace events (microseconds since ``origin``; device events when recorded)."""
    out = []
    for t in timings:
        out.append({
            "lane": t.lane,
            "name": t.task,
            "start_us": (t.host_start - origin) * 1e6,
            "dur_us": (t.host_end - t.host_start) * 1e6,
        })
    return out
