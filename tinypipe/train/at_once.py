"""SIGTERM ends a rank of a multi-rank run at once, cleanly: one line, exit 143, the last complete
checkpoint intact and no ``checkpoint.tmp`` left.

Why not after the current step, as a lone process stops: torchrun sends SIGTERM to every other
rank when one fails, and SIGKILL 30 s later. A rank then sits in a collective with the dead peer,
and the graceful stop's last checkpoint is itself collective -- it would wait out the 30 s and be
killed mid-write. Nor can a Python signal handler stop it: it runs only between bytecodes of the
main thread, and that thread is inside a C++ wait. The C-level handler does write the signal's
number to :func:`signal.set_wakeup_fd`'s descriptor from whichever thread it lands on, so a thread
here reads it and ends the process through the engine's
:class:`~tinypipe.runtime.exit_guard.ExitGuard` (which waits for a checkpoint swap under way and
removes a partial one).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

#: the exit status of a rank stopped by SIGTERM (128 + 15, as the shell reports a process it ended)
TERM_EXIT_CODE = 128 + signal.SIGTERM


@contextmanager
def on_signals(signums: tuple[int, ...], act: Callable[[int], None]) -> Iterator[None]:
    """Call ``act(signum)`` in a listener thread as soon as one of ``signums`` arrives, even while
    the main thread is blocked in C code. The signals need Python handlers installed (the C-level
    handler writes to the wakeup descriptor only for those); those handlers still run when the
    main thread gets to them. Main thread only (elsewhere: nothing is installed)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def listen() -> None:
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            if previous >= 0:  # someone else's wakeup descriptor still hears its signals
                try:
                    os.write(previous, data)
                except OSError:
                    pass
            for signum in data:
                if signum in signums:
                    act(signum)

    thread = threading.Thread(target=listen, name="tinypipe-signals", daemon=True)
    thread.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        writer.shutdown(socket.SHUT_RDWR)  # the listener reads end-of-file and returns
        writer.close()
        thread.join(timeout=5.0)
        reader.close()
