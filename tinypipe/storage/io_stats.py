"""Byte and time counters of the SSD tier, for metrics (bytes and GB/s per step) and trace lanes.

Throughput is bytes over *busy* time -- the wall time during which at least one request of that
direction was being transferred -- not over the sum of request durations: with eight requests in
flight the sum is eight times the wall time and would understate the rate eightfold.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, fields

#: Completed requests kept for :meth:`IoStats.take_records` when nobody drains them (bounded memory).
MAX_RECORDS = 1 << 13  # ~1.6 MB at most; a 7B step makes ~400
OPS = ("read", "write")


@dataclass(frozen=True)
class IoRecord:
    """One completed request; times are ``time.perf_counter()`` seconds (the trace's clock)."""

    op: str
    key: Hashable
    nbytes: int
    submitted: float
    started: float
    finished: float
    error: str | None = None

    @property
    def lane(self) -> str:
        return f"ssd:{self.op}"

    @property
    def seconds(self) -> float:
        return self.finished - self.started

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class IoTotals:
    """Cumulative counters; ``after - before`` gives one step's."""

    read_bytes: int = 0
    write_bytes: int = 0
    read_requests: int = 0
    write_requests: int = 0
    read_busy_s: float = 0.0
    write_busy_s: float = 0.0
    errors: int = 0

    def __sub__(self, other: IoTotals) -> IoTotals:
        return IoTotals(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    @property
    def read_gbps(self) -> float:
        return self.read_bytes / self.read_busy_s / 1e9 if self.read_busy_s > 0 else 0.0

    @property
    def write_gbps(self) -> float:
        return self.write_bytes / self.write_busy_s / 1e9 if self.write_busy_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["read_gbps"], out["write_gbps"] = self.read_gbps, self.write_gbps
        return out


class IoStats:
    """Thread-safe counters fed by the store's workers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = dict.fromkeys(OPS, 0)
        self._since = dict.fromkeys(OPS, 0.0)
        self._busy = dict.fromkeys(OPS, 0.0)
        self._bytes = dict.fromkeys(OPS, 0)
        self._requests = dict.fromkeys(OPS, 0)
        self._errors = 0
        self._records: collections.deque[IoRecord] = collections.deque(maxlen=MAX_RECORDS)

    def started(self, op: str, now: float) -> None:
        with self._lock:
            if self._active[op] == 0:
                self._since[op] = now
            self._active[op] += 1

    def finished(self, record: IoRecord) -> None:
        op = record.op
        with self._lock:
            self._active[op] -= 1
            if self._active[op] == 0:
                self._busy[op] += record.finished - self._since[op]
            self._requests[op] += 1
            if record.error is None:
                self._bytes[op] += record.nbytes
            else:
                self._errors += 1
            self._records.append(record)

    def totals(self) -> IoTotals:
        """Counters now; busy time includes the running part of requests in flight."""
        now = time.perf_counter()
        with self._lock:
            busy = {op: self._busy[op] + (now - self._since[op] if self._active[op] else 0.0) for op in OPS}
            return IoTotals(self._bytes["read"], self._bytes["write"], self._requests["read"],
                            self._requests["write"], busy["read"], busy["write"], self._errors)

    def take_records(self) -> list[IoRecord]:
        """The completed requests since the last call (oldest first), for trace lanes."""
        with self._lock:
            out = list(self._records)
            self._records.clear()
            return out
