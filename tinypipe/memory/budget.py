"""Host memory the engine may still take, checked before it allocates its store.

On Linux an allocation larger than what is free usually *succeeds* (overcommit) and the process is
killed later, while the store is first written: no message, no traceback, just ``Killed``. So the
engine compares what it is about to allocate with what is available first and fails with one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from tinypipe.errors import PlanDoesNotFitError

GiB = 1024**3
SKIP_ENV = "TINYPIPE_SKIP_HOST_MEMORY_CHECK"


def _cgroup_headroom() -> int | None:
    """Bytes left under this process's cgroup (v2 or v1) memory limit, if it has one."""
    candidates = [
        (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
        (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
         Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")),
    ]
    for limit_file, usage_file in candidates:
        try:
            limit_text = limit_file.read_text().strip()
            if limit_text == "max":
                return None
            limit, usage = int(limit_text), int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 1 << 60:  # "unlimited" in v1
            return None
        return max(0, limit - usage)
    return None


def host_available() -> int:
    """Bytes this process can still allocate: the OS's available memory, capped by a cgroup limit."""
    available = int(psutil.virtual_memory().available)
    headroom = _cgroup_headroom()
    return min(available, headroom) if headroom is not None else available


def check_host_memory(need: int, what: str) -> None:
    """Raise :class:`PlanDoesNotFitError` (one line) when ``need`` bytes are not available."""
    if os.environ.get(SKIP_ENV):
        return
    have = host_available()
    if need > have:
        raise PlanDoesNotFitError(
            f"host memory: {what} needs {need / GiB:.2f} GiB, only {have / GiB:.2f} GiB available; "
            f"free memory, use a smaller model or LoRA, or run `tinypipe plan` to see what fits "
            f"(set {SKIP_ENV}=1 to try anyway)"
        )
