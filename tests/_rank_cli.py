"""One rank of ``tinypipe finetune`` (spawned by tests/test_reliability_ranks.py), with a test hook:
``TINYPIPE_TEST_PAUSE=PHASE:N:READY`` pauses this process's N-th checkpoint-save phase PHASE
(runtime/checkpoint.py: FAULT_HOOK) -- it writes the file READY, then sleeps -- so a signal lands
mid-save for certain."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def _pause_at(spec: str) -> None:
    import tinypipe.runtime.checkpoint as checkpoint

    phase, nth, ready = spec.split(":", 2)
    seen = [0]

    def hook(name: str) -> None:
        if name != phase:
            return
        seen[0] += 1
        if seen[0] == int(nth):
            Path(ready).write_text(str(os.getpid()))
            time.sleep(60)

    checkpoint.FAULT_HOOK = hook


if __name__ == "__main__":
    if os.environ.get("TINYPIPE_TEST_PAUSE"):
        _pause_at(os.environ["TINYPIPE_TEST_PAUSE"])
    from tinypipe.cli import main

    sys.exit(main(sys.argv[1:]))
