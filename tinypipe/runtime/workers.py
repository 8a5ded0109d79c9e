"""Persistent lane worker threads, reused by every step of an engine.

A step used to start one thread per lane and let it end: on glibc each new thread may be given a
fresh malloc arena, and with a thread per lane per step the arenas' retained free memory made
host RSS creep upwards over the first tens of steps. One long-lived thread per lane keeps the same
threads (and arenas) for the whole run. A worker idle for ``IDLE_EXIT_S`` exits; the next step that
needs its lane starts a new one. After a failed step the engine shuts its workers down (the next
step starts fresh ones), so no thread outlives an error except one stuck inside a task.

A worker's thread name says what it is doing: ``tinypipe-<lane>`` while it runs a step's lane (as
the per-step threads were named), ``tinypipe idle worker <lane>`` while it waits for the next step.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from tinypipe.schedule.ids import Lane

IDLE_EXIT_S = 30.0


def _idle_name(lane: Lane) -> str:
    return f"tinypipe idle worker {lane}"


class _Worker:
    def __init__(self, lane: Lane, pool: "LaneWorkers") -> None:
        self.lane = lane
        self.pool = pool
        self.queue: "queue.Queue[tuple[Callable[[], None], threading.Event] | None]" = queue.Queue()
        self.busy = False
        self.alive = True
        self.thread = threading.Thread(target=self._run, name=_idle_name(lane), daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                item = self.queue.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                if self.pool.retire(self):
                    return
                continue
            if item is None:
                return
            fn, done = item
            self.thread.name = f"tinypipe-{self.lane}"
            try:
                fn()
            except BaseException:  # noqa: BLE001 - the lane reports its own errors; the worker must survive
                pass
            finally:
                self.thread.name = _idle_name(self.lane)
                self.busy = False
                done.set()
                fn = done = item = None  # type: ignore[assignment] # drop the step's references now


class LaneWorkers:
    """One persistent thread per lane; :meth:`submit` runs a callable on a lane's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: dict[Lane, _Worker] = {}

    def submit(self, lane: Lane, fn: Callable[[], None]) -> threading.Event:
        """Run ``fn`` on ``lane``'s worker; the returned event is set when it has returned."""
        done = threading.Event()
        with self._lock:
            w = self._workers.get(lane)
            # busy: stuck in an abandoned step -- never reuse it
            if w is None or not w.alive or w.busy or not w.thread.is_alive():
                w = _Worker(lane, self)
                self._workers[lane] = w
            w.busy = True
            w.queue.put((fn, done))
        return done

    def retire(self, worker: _Worker) -> bool:
        """Let an idle ``worker`` exit unless work reached it meanwhile; whether it may."""
        with self._lock:
            if worker.busy or not worker.queue.empty():
                return False
            worker.alive = False
            if self._workers.get(worker.lane) is worker:
                del self._workers[worker.lane]
            return True

    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return [w.thread for w in self._workers.values()]

    def shutdown(self, timeout: float = 1.0) -> None:
        """Stop every idle worker (join up to ``timeout`` s each); a stuck one is abandoned."""
        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
            for w in workers:
                w.alive = False
                w.queue.put(None)
        for w in workers:
            if not w.busy:
                w.thread.join(timeout)
