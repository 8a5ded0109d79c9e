"""A write that fails after training began (disk full, ``ulimit -f``, permissions) must not take the
trained model with it: the engine still holds it, so it is saved somewhere else before the run
stops with one line that says where (or, when that fails too, that the last checkpoint holds the
state and ``--resume`` finishes the run once there is room).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from tinypipe.errors import WriteError
from tinypipe.write_errors import as_os_error, describe, os_errors


def rescue(engine: Any, tokenizer: Any, failure: WriteError, checkpoint: Path | None) -> WriteError:
    """The one-line error to raise for ``failure``, after saving the model (or adapter) and tokenizer
    to a new directory under the system's temporary directory (``TMPDIR``)."""
    named = checkpoint is not None and str(checkpoint) in str(failure)
    resume = "" if checkpoint is None else (
        f"; once there is room, the same command with --resume continues from "
        f"{'that checkpoint' if named else checkpoint}")
    if engine.replicas is not None:  # a collective save: every rank would have to agree on the place
        return WriteError(f"{failure}{resume}")
    where = Path(tempfile.mkdtemp(prefix="tinypipe-rescued-"))
    try:
        with os_errors():
            engine.save_pretrained(where)
            tokenizer.save_pretrained(str(where))
    except Exception as exc:  # noqa: BLE001 - the second failure is reported, not raised
        shutil.rmtree(where, ignore_errors=True)  # ours: made above
        second = as_os_error(exc)
        why = describe(second) if second is not None else " ".join(str(exc).split())
        return WriteError(f"{failure}; saving the model to {where.parent} failed too ({why}){resume}")
    return WriteError(f"{failure}; the trained model was saved to {where} instead{resume}")
