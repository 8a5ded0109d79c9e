"""Dead or hung peers: a heartbeat through the rendezvous store, so no rank waits forever.

Every rank's daemon thread writes ``tinypipe/hb/<rank>`` (a counter) every ``interval_s`` and reads
the others'. A peer whose counter has not moved for ``timeout_s`` (killed, stopped, wedged) or
whose store is gone (rank 0 hosts torchrun's store) is named in one ``tinypipe:`` line and this
process exits: a collective waiting on a dead peer cannot be interrupted from Python, and a
replica that stays would hang its launcher. Collectives also carry the process group's timeout
(the second line of defence, :func:`tinypipe.distributed.group.replicas_from_environment`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

LEFT = "left"  # a rank's heartbeat value once it closed its engine
EXIT_CODE = 75  # a peer failed (EX_TEMPFAIL: rerun from the last checkpoint)


def _default_exit(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)


class Watchdog:
    """The heartbeat thread of one rank (:meth:`start` once every rank has written its key)."""

    def __init__(self, store: object, rank: int, world_size: int, *, timeout_s: float = 30.0,
                 interval_s: float = 1.0, on_dead: Callable[[str], None] = _default_exit) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.on_dead = on_dead
        self._stop = threading.Event()
        self._beats = 0
        self._seen: dict[int, tuple[bytes, float]] = {}  # peer -> (last counter, when it changed)
        self._thread: threading.Thread | None = None
        self.dead: str | None = None  # the message, once a peer is declared gone

    def _key(self, rank: int) -> str:
        return f"tinypipe/hb/{rank}"

    def beat(self) -> None:
        self._beats += 1
        self.store.set(self._key(self.rank), str(self._beats))  # type: ignore[attr-defined]

    def start(self) -> None:
        self.beat()
        now = time.monotonic()
        self._seen = {r: (b"", now) for r in range(self.world_size) if r != self.rank}
        self._thread = threading.Thread(target=self._run, name="tinypipe-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and tell the peers this rank left on purpose (they stop watching it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s)
        try:
            self.store.set(self._key(self.rank), LEFT)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the store's host left first: nobody is watching
            pass

    def check(self) -> str | None:
        """One round: beat, read the peers; the message naming a dead peer, or None."""
        try:
            self.beat()
        except Exception as exc:  # noqa: BLE001 - the store's host is gone
            return (f"tinypipe: rank 0 (the rendezvous store's host) is gone ({type(exc).__name__}); "
                    f"rank {self.rank} stops")
        now = time.monotonic()
        for r, (last, since) in self._seen.items():
            try:
                key = self._key(r)
                store = self.store
                value = store.get(key) if store.check([key]) else b""  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001
                return (f"tinypipe: rank 0 (the rendezvous store's host) is gone ({type(exc).__name__}); "
                        f"rank {self.rank} stops")
            if value == LEFT.encode():
                continue
            if value != last:
                self._seen[r] = (value, now)
            elif now - since > self.timeout_s:
                return (f"tinypipe: rank {r} stopped responding (no heartbeat for {now - since:.0f} s: "
                        f"killed, stopped or hung); rank {self.rank} stops")
        return None

    def await_verdict(self) -> str | None:
        """Wait up to one timeout (plus a few beats) for a dead peer to be named; the message, or
        None if every peer kept beating (the failure was this rank's own)."""
        deadline = time.monotonic() + self.timeout_s + 3 * self.interval_s
        while self.dead is None and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(self.interval_s / 4)
        return self.dead

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            message = self.check()
            if message is not None and not self._stop.is_set():
                self.dead = message
                self.on_dead(message)
                return
