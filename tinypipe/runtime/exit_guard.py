"""Ending the process at once from any thread -- a dead peer, SIGTERM to a rank -- without leaving a
half-written checkpoint.

A rank that must stop cannot wait for its main thread: that thread may sit in a collective with a
dead peer (a C++ wait no Python signal handler interrupts) or in a checkpoint write. So the thread
that decides (the watchdog, the SIGTERM listener) ends the process with ``os._exit``, and this
guard makes that safe for the checkpoint: saves register the temporary directory they fill
(:meth:`writing`) and hold the guard across the renames that swap it in (:meth:`committing`).
:meth:`exit_now` waits for a swap under way to finish (renames: milliseconds), removes the
registered temporary directories, tells the peers (``on_exit`` callbacks), prints its one line and
exits. The previous checkpoint -- or the one just swapped in -- stays whole; no ``checkpoint.tmp``
is left. Holding the guard for good, it keeps the main thread from starting another save.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, NoReturn

#: the most an exit waits for a checkpoint swap under way (its renames take milliseconds)
COMMIT_WAIT_S = 20.0


class ExitGuard:
    """One engine's saves in progress and the way out (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held by a swap, and for good by the exit
        self._once = threading.Lock()  # the first exit_now wins; a second caller waits for the end
        self._partial: list[Path] = []
        self._on_exit: list[Callable[[], None]] = []
        #: what is appended to the exit line, asked once any swap is done (the train loop: which
        #: checkpoint is intact)
        self.describe: Callable[[], str] | None = None

    def on_exit(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the way out (before the line; errors ignored): telling the peers."""
        self._on_exit.append(callback)

    @contextmanager
    def writing(self, tmp: Path, create: bool) -> Iterator[None]:
        """A save fills ``tmp`` in the body (``create``: remove a stale one and make it here, under
        the guard, so an exit cannot miss it); an exit meanwhile removes it."""
        with self._lock:
            if create:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
            self._partial.append(tmp)
        try:
            yield
        finally:
            with self._lock:
                self._forget(tmp)

    @contextmanager
    def committing(self, tmp: Path) -> Iterator[None]:
        """The body swaps the complete ``tmp`` in: an exit waits until it is done (and leaves the
        directory to it)."""
        with self._lock:
            self._forget(tmp)
            yield

    def _forget(self, tmp: Path) -> None:
        if tmp in self._partial:
            self._partial.remove(tmp)

    def exit_now(self, line: str, code: int) -> NoReturn:
        """End the process with ``line`` (plus :attr:`describe`'s words) on stderr and exit status
        ``code``."""
        self._once.acquire()  # a second caller blocks here until the process is gone
        self._lock.acquire(timeout=COMMIT_WAIT_S)  # never released: no save starts after this
        for callback in self._on_exit:
            try:
                callback()
            except Exception:  # noqa: BLE001 - on the way out: the line matters more
                pass
        for tmp in self._partial:
            _remove(tmp)
        try:
            note = self.describe() if self.describe is not None else ""
        except Exception:  # noqa: BLE001 - the line without its note
            note = ""
        try:
            print(line + note, file=sys.stderr, flush=True)
        finally:
            os._exit(code)


def _remove(tmp: Path) -> None:
    """Remove a partial directory (a writer may still be adding a file: retry a few times)."""
    for _ in range(20):
        shutil.rmtree(tmp, ignore_errors=True)
        if not tmp.exists():
            return
        time.sleep(0.01)
