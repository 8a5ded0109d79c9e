"""Dead or hung peers, so no rank waits forever: one thread per rank watches its peers two ways.

A peer whose process ended is seen at once through its connection (:mod:`~tinypipe.distributed.links`):
one that died (killed, crashed) ends this process within milliseconds; one that said it stops (an
error or a signal ended it) after :data:`STOP_GRACE_S`, time for this rank to end on its own when it
met the same error (every rank refusing the same config) -- a peer that said it left (its run is
over) is no longer watched. A peer alive but silent (SIGSTOP, wedged) is found by the heartbeat:
the thread writes ``tinypipe/hb/<rank>`` (a counter) every ``interval_s`` and reads the others'; a
counter that has not moved for ``timeout_s``, or the store gone (rank 0 hosts it without torchrun's
agent), ends this process too. Each verdict is one ``tinypipe: rank K ...`` line, through
``on_dead`` (the engine's :class:`~tinypipe.runtime.exit_guard.ExitGuard`: no half-written
checkpoint is left). Exiting is the only way out: a collective waiting on a dead peer cannot be
interrupted from Python, and a replica that stays would hang its launcher. Collectives also carry
the process group's timeout (the second line of defence,
:func:`tinypipe.distributed.group.replicas_from_environment`).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Callable

from tinypipe.distributed.links import LEAVING, STOPPING, PeerLinks

LEFT = "left"  # a rank's heartbeat value once it closed its engine
EXIT_CODE = 75  # a peer failed (EX_TEMPFAIL: rerun from the last checkpoint)
#: seconds a rank gives itself to end on its own after a peer said it stops (the same error on
#: every rank ends each with its own line); a silent death ends it at once
STOP_GRACE_S = 2.0


def _default_exit(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)


class Watchdog:
    """The watching thread of one rank: its peers' connections (``links``) and heartbeats
    (:meth:`start` once every rank has written its heartbeat key)."""

    def __init__(self, store: object, rank: int, world_size: int, *, timeout_s: float = 30.0,
                 interval_s: float = 1.0, on_dead: Callable[[str], None] = _default_exit,
                 links: PeerLinks | None = None, grace_s: float = STOP_GRACE_S) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.interval_s, self.grace_s = timeout_s, interval_s, grace_s
        self.on_dead = on_dead
        self.links = links
        self._stop = threading.Event()
        self._beats = 0
        self._seen: dict[int, tuple[bytes, float]] = {}  # peer -> (last counter, when it changed)
        self._left: set[int] = set()  # peers that said their run is over
        self._stopping: dict[int, float] = {}  # peers that said they stop -> when
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
        atexit.register(self.say_stopping)  # the interpreter ends without stop(): an error ended it

    def stop(self, leaving: bool = True) -> None:
        """Stop watching and tell the peers how this rank ends: ``leaving`` (its run is over: they
        stop watching it) or not (an error ends it: they stop too, after their grace)."""
        atexit.unregister(self.say_stopping)
        self._stop.set()
        if self.links is not None:
            self.links.wake()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s)
        if self.links is not None:
            self.links.say(LEAVING if leaving else STOPPING)
            self.links.close()
        if not leaving:  # the heartbeat stops: peers without a link name this rank after their timeout
            return
        try:
            self.store.set(self._key(self.rank), LEFT)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the store's host left first: nobody is watching
            pass

    def ending(self) -> None:
        """This rank is ending on its own (closing its engine, maybe after the same error its peers
        met): a peer that says it stops no longer ends it after the short grace -- the teardown
        (unpinning a large host copy) may take longer, and this rank's own line must come out --
        only after the heartbeat's timeout (a teardown hung on a gone peer); a death still at once."""
        self.grace_s = max(self.grace_s, self.timeout_s)

    def say_stopping(self) -> None:
        """Tell the peers this rank stops now (an error, a signal, a dead peer): from any thread, on
        the way out (no store write: the store's host may be the peer that hangs)."""
        if self.links is not None:
            self.links.say(STOPPING)

    def check(self) -> str | None:
        """One round: beat, read the peers; the message naming a dead peer, or None."""
        try:
            self.beat()
        except Exception as exc:  # noqa: BLE001 - the store's host is gone
            return (f"tinypipe: rank 0 (the rendezvous store's host) is gone ({type(exc).__name__}); "
                    f"rank {self.rank} stops")
        now = time.monotonic()
        for r, (last, since) in self._seen.items():
            if r in self._left or r in self._stopping:  # said how it ends: judged by :meth:`_judge`
                continue
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
        None if every peer kept beating (the failure was this rank's own). A peer that said it
        stops is judged at once now: this rank's own work already failed, it will not end on its own."""
        self.grace_s = 0.0
        if self.links is not None:
            self.links.wake()
        deadline = time.monotonic() + self.timeout_s + 3 * self.interval_s
        while self.dead is None and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(self.interval_s / 4)
        return self.dead

    def _judge(self, news: list[tuple[int, str]]) -> str | None:
        """The verdict on what the links reported (a death first), or None while peers may still
        be waited for."""
        now = time.monotonic()
        for r, event in news:
            if event == "died":
                return (f"tinypipe: rank {r} died (its process ended without a word: killed -- SIGKILL, "
                        f"the OOM killer -- or crashed); rank {self.rank} stops")
            if event == "left":
                self._left.add(r)
            else:
                self._stopping.setdefault(r, now)
        for r, since in sorted(self._stopping.items()):
            if now - since >= self.grace_s:
                return (f"tinypipe: rank {r} stopped (an error or a signal ended it: its own output says "
                        f"which); rank {self.rank} stops")
        return None

    def _next_wake(self, next_beat: float) -> float:
        """Seconds until the next heartbeat round or the end of a stopping peer's grace."""
        due = min([next_beat, *(since + self.grace_s for since in self._stopping.values())])
        return max(0.0, due - time.monotonic())

    def _run(self) -> None:
        next_beat = time.monotonic() + self.interval_s
        while not self._stop.is_set():
            wait_s = self._next_wake(next_beat)
            if self.links is not None:
                news = self.links.wait(wait_s)
            else:
                self._stop.wait(wait_s)
                news = []
            if self._stop.is_set():
                return
            message = self._judge(news)
            if message is None and time.monotonic() >= next_beat:
                message = self.check()
                next_beat = time.monotonic() + self.interval_s
            if message is not None and not self._stop.is_set():
                self.dead = message
                self.on_dead(message)
                return
