"""Sizes of the SSD tier for host-stashed block inputs (``Plan.stash_on_ssd``), shared by the
planner and the runtime (:mod:`tinypipe.runtime.ssd_stash`) so both count the same bytes.

Each stashed boundary keeps one region per batch row (one sequence, ``seq x hidden`` elements in the
compute dtype) in a scratch file of the offload directory (striped over several, as the optimizer
state's); a staging pool of :data:`STASH_SLOTS` page-aligned slots, each the largest micro-batch's
rows (every row starting on a page), carries rows between the devices and the files: a forward
write lands in a slot and is written from it, a read-back reads into a slot and is copied up from it.
"""

from __future__ import annotations

from tinypipe.storage.direct import align_up
from tinypipe.storage.store import bounce_bytes

#: Staging slots: two writes in flight (the forward's micro-batches, the backward's gradient rows),
#: one read-back being consumed and one read ahead.
STASH_SLOTS = 4
#: Name of the memory report's host category for the pool (and the store's bounce pages).
STASH_STAGING_CATEGORY = "ssd_stash_staging"


def row_bytes(seq: int, hidden: int, itemsize: int) -> int:
    """One batch row's bytes, rounded up to a page (its region and its place in a slot)."""
    return align_up(seq * hidden * itemsize)


def slot_rows(micro_batch_size: int, backward_micro_batch_size: int, batch: int) -> int:
    """Rows a staging slot holds: the largest micro-batch (at most the batch)."""
    return max(1, min(batch, max(micro_batch_size, backward_micro_batch_size)))


def staging_bytes(boundaries: int, *, batch: int, seq: int, hidden: int, itemsize: int,
                  micro_batch_size: int, backward_micro_batch_size: int, directories: int = 1) -> int:
    """Host bytes of the pool plus the stash store's bounce pages (0 without SSD boundaries)."""
    if not boundaries:
        return 0
    rows = slot_rows(micro_batch_size, backward_micro_batch_size, batch)
    return STASH_SLOTS * rows * row_bytes(seq, hidden, itemsize) + bounce_bytes(directories=directories)


def disk_bytes(boundaries: int, *, batch: int, seq: int, hidden: int, itemsize: int) -> int:
    """Scratch-file bytes of ``boundaries`` stashed boundaries."""
    return boundaries * batch * row_bytes(seq, hidden, itemsize)
