"""One run per output directory: two runs writing one ``metrics.jsonl`` and one checkpoint interleave
them (the metrics unparseable after) and one of them crashes. Each run holds an exclusive
``fcntl.flock`` on ``OUTPUT/.tinypipe.lock`` until it ends (the kernel drops it when the process dies,
so a killed run never leaves a stale lock); a second run is refused in one line. Under torchrun the
ranks of one run share the directory: rank 0 takes the lock for them.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tinypipe.errors import ConfigError

LOCK_NAME = ".tinypipe.lock"


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold ``out``'s lock for the ``with`` body; one-line ConfigError when another run holds it."""
    if os.environ.get("RANK", "0") != "0":
        yield
        return
    path = out / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ConfigError(f"--output {out} is in use by another tinypipe run (pid {holder}, {path}): "
                              "wait for it to finish or choose another --output") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
