"""Completion signals between lanes, and step-wide abort.

A :class:`Signal` is set by the lane that ran a task, after the task's device work was *queued*
(CUDA) or *done* (CPU). Waiting on it blocks the host only until the work is queued; the device
stream then waits on the recorded event, so CUDA lanes run ahead of the GPU while staying
ordered. Every blocking wait polls the step's :class:`Abort`, so one failing worker stops all
others within a poll interval instead of hanging them.
"""

from __future__ import annotations

import threading

from tinypipe.devices.backend import Backend

POLL_S = 0.05


class Aborted(Exception):
    """Raised in a waiting worker when another worker failed."""


class Abort:
    """First failure of the step: which lane and task, and the exception."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.where: str = ""
        self.error: BaseException | None = None

    def fail(self, where: str, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.where, self.error = where, error
        self._event.set()

    @property
    def failed(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise Aborted(self.where)


class Signal:
    """Set once when a task's work has been queued (CUDA) or completed (CPU)."""

    __slots__ = ("_set", "events")

    def __init__(self) -> None:
        self._set = threading.Event()
        self.events: list[object] = []

    @property
    def is_set(self) -> bool:
        return self._set.is_set()

    def fire(self, backend: Backend | None, streams: list[object]) -> None:
        """Mark done; on CUDA record an event on every stream the task's work went to."""
        if backend is not None and backend.is_cuda:
            self.events = [backend.record_event(s) for s in streams]
        self._set.set()

    def wait_host(self, abort: Abort) -> None:
        """Block until the producer has queued its work."""
        while not self._set.wait(POLL_S):
            abort.check()
        abort.check()

    def wait(self, abort: Abort, backend: Backend | None, stream: object) -> None:
        """Order ``stream`` after the task (host waits only for the enqueue)."""
        self.wait_host(abort)
        for event in self.events:
            if backend is not None and backend.is_cuda:
                backend.wait_event(stream, event)
            else:  # a host consumer of device work: wait for completion
                event.synchronize()  # type: ignore[attr-defined]

    def synchronize(self, abort: Abort) -> None:
        """Block the host until the task's device work is complete."""
        self.wait_host(abort)
        for event in self.events:
            event.synchronize()  # type: ignore[attr-defined]
