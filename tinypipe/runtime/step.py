"""Execute one schedule: a thread per lane, each running its tasks in order.

Lanes: per device ``compute``, ``h2d`` (uploads) and ``d2h`` (gradient downloads), plus one host
``optimizer`` lane. A task first waits for its dependencies' signals (the host only until the
producer has queued its work; the lane's stream then waits on the producer's event), runs, and
fires its own signal. Any exception aborts the step: every waiting lane notices within a poll
interval and the caller gets the first error with its lane and task.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Callable

import torch

from tinypipe.errors import WorkerError
from tinypipe.runtime.buffers import RowBuffer
from tinypipe.runtime.context import StepContext, TaskTiming
from tinypipe.runtime.handlers import TaskHandlers
from tinypipe.runtime.inputs import StepInputs
from tinypipe.runtime.optim.messages import GradStream
from tinypipe.runtime.resources import EngineResources
from tinypipe.runtime.signals import Aborted, Signal
from tinypipe.schedule.ids import OPTIMIZER_LANE, Lane, TaskId
from tinypipe.schedule.plan import host_gradient_boundaries, host_stashed_inputs
from tinypipe.schedule.tasks import STREAMING_KINDS, Schedule, Task

ABORT_GRACE_S = 2.0  # after an abort, how long lanes get to notice before the step gives up on them


class StepRunner:
    """Runs schedules with the engine's resources: :meth:`new_context` then :meth:`run`."""

    def __init__(self, res: EngineResources) -> None:
        self.res = res

    def new_context(self, schedule: Schedule, inputs: StepInputs,
                    fault: Callable[[Task], None] | None = None) -> StepContext:
        """A step's state: pack-boundary buffers (device buffers allocated on first write, host
        stash buffers prepared by the engine), one signal per task, one gradient stream per layer."""
        res, plan = self.res, schedule.plan
        shape = (inputs.batch, inputs.seq, res.hidden_size)
        P = plan.num_packs

        def on_device(dev_index: int) -> RowBuffer:
            d = res.devices[dev_index]
            return RowBuffer(shape, res.compute_dtype, d.backend, d.streams["compute"])

        acts = []
        # host-stashed pack inputs; at long sequences the embedding's output too (host_stashed_inputs)
        on_host = host_stashed_inputs(plan, res.long_sequences)
        for q in range(P + 1):
            if q in plan.stash_on_ssd:  # in the offload directory's files (runtime/ssd_stash.py)
                acts.append(res.ssd_stash.rows(q))
            elif on_host[q]:
                host = res.host_stash.buffer(q, shape, res.compute_dtype)
                acts.append(RowBuffer(shape, res.compute_dtype, None, host=host))
            else:
                acts.append(on_device(plan.embed_device if q == 0 else
                                      (plan.fwd_device[q] if q < P else plan.head_device)))
        # a host-stashed boundary's gradient may reuse its stash's rows (host_gradient_boundaries)
        host_grads = host_gradient_boundaries(plan, res.long_sequences)
        # (an SSD boundary's gradient: into the same rows of its files)
        grads = [acts[q] if host_grads[q] and q in plan.stash_on_ssd
                 else RowBuffer(shape, res.compute_dtype, None, host=acts[q].tensor) if host_grads[q]
                 else on_device(plan.embed_device if q == 0 else plan.bwd_device[q - 1])
                 for q in range(P + 1)]
        return StepContext(
            schedule=schedule, inputs=inputs, acts=acts, grads=grads,
            signals={tid: Signal() for tid in schedule.tasks},
            grad_streams={layer: GradStream() for layer in range(schedule.num_layers)},
            fault=fault,
        )

    def run(self, ctx: StepContext) -> None:
        """Run every lane of ``ctx.schedule`` on the engine's lane workers until all are done;
        WorkerError for the first failure (``ctx.stuck`` names lanes that never returned)."""
        handlers = TaskHandlers(self.res, ctx)
        workers = self.res.workers
        done = [workers.submit(lane, functools.partial(self._lane, ctx, handlers, lane, ids))
                for lane, ids in ctx.schedule.lanes.items()]
        self._supervise(ctx, done)

    def _supervise(self, ctx: StepContext, done: list[threading.Event]) -> None:
        last_progress, last_count = time.monotonic(), 0
        aborted_at: float | None = None
        abort, stall = ctx.abort, self.res.stall_timeout_s
        ctx.stuck = ""
        while not all(d.is_set() for d in done):
            for d in done:
                d.wait(timeout=0.1)
            now = time.monotonic()
            count = len(ctx.timings)
            if count != last_count:
                last_progress, last_count = now, count
            elif now - last_progress > stall and not abort.failed:
                abort.fail("watchdog", TimeoutError(
                    f"no task finished for {stall:.0f} s; waiting: {_waiting(ctx)}"))
            if abort.failed:
                aborted_at = aborted_at or now
                if now - aborted_at > ABORT_GRACE_S:  # a lane stuck inside a task: give up on it
                    ctx.stuck = _waiting(ctx)
                    break
        for stream in ctx.grad_streams.values():  # chunks an aborted update never consumed
            stream.drain()
        if abort.error is not None:
            err = abort.error
            raise WorkerError(f"{abort.where} failed: {type(err).__name__}: {err}") from err
        for d in self.res.devices:
            d.backend.synchronize()

    def _lane(self, ctx: StepContext, handlers: TaskHandlers, lane: Lane, ids: list[TaskId]) -> None:
        """Run ``lane``'s tasks in order (on its worker thread)."""
        tid: TaskId | None = None
        if lane == OPTIMIZER_LANE and self.res.optimizer_threads:
            torch.set_num_threads(self.res.optimizer_threads)
        # every task of a device lane runs on that device and feeds the lane's stream
        dev = self.res.devices[lane.device] if lane.device is not None else None
        backend = dev.backend if dev is not None else None
        stream = dev.streams[lane.name] if dev is not None else None
        if dev is not None and dev.backend.is_cuda:
            torch.cuda.set_device(dev.device)  # kernels of this lane default here
        timed = self.res.trace and backend is not None and backend.is_cuda
        tasks, signals, abort, side = ctx.schedule.tasks, ctx.signals, ctx.abort, ctx.side_streams
        try:
            for tid in ids:
                ctx.current[lane] = tid
                task = tasks[tid]
                if task.kind not in STREAMING_KINDS:  # an UPDATE streams its download's chunks
                    for dep in task.deps:
                        signals[dep].wait(abort, backend, stream)
                start = time.perf_counter()
                ev0 = backend.record_event(stream, timing=True) if timed and backend else None
                side[lane] = []
                if dev is not None:
                    with dev.backend.use_stream(stream):
                        handlers.run(task, dev)
                else:
                    handlers.run(task, None)
                ev1 = backend.record_event(stream, timing=True) if ev0 is not None and backend else None
                signals[tid].fire(backend, [stream] + side[lane])
                ctx.timings.append(
                    TaskTiming(lane, tid, start, time.perf_counter(), (ev0, ev1) if ev0 is not None else None)
                )
        except Aborted:
            return
        except BaseException as exc:  # noqa: BLE001 - surfaced to the caller by run()
            abort.fail(f"{lane} task {tid}", exc)
        finally:
            ctx.current[lane] = None


def _waiting(ctx: StepContext) -> str:
    """Each lane's current task (for stall reports), lanes in the order of their names."""
    return ", ".join(f"{lane}:{tid}" for lane, tid in sorted(ctx.current.items(), key=lambda kv: str(kv[0]))
                     if tid is not None)

