"""``python tests/_kill_child.py ARGS``: runs ``tinypipe ARGS`` for tests/test_kill.py.

With ``TINYPIPE_TEST_PAUSE=phase:nth:marker`` in the environment, the checkpoint writer stops the
``nth`` time it reaches ``phase`` (see ``tinypipe.runtime.checkpoint.FAULT_HOOK``): it writes
``marker`` and sleeps, so the parent's SIGKILL lands exactly there.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main() -> int:
    spec = os.environ.get("TINYPIPE_TEST_PAUSE")
    if spec:
        from tinypipe.runtime import checkpoint

        phase, nth, marker = spec.split(":", 2)
        seen = {"n": 0}

        def pause(name: str) -> None:
            if name != phase:
                return
            seen["n"] += 1
            if seen["n"] == int(nth):
                Path(marker).write_text(name)
                time.sleep(300)

        checkpoint.FAULT_HOOK = pause
    from tinypipe import cli

    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
