"""Tasks and schedules: what runs where, in which order, after what."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tinypipe.schedule.plan import Plan


class Kind(str, enum.Enum):
    RESIDENT_UPLOAD = "resident_upload"  # embedding / head into their dedicated buffers
    UPLOAD = "upload"  # a block layer into a layer slot
    EMBED_FWD = "embed_fwd"  # whole global batch: token ids -> hidden states + block arguments
    FWD = "fwd"  # one pack x one forward micro-batch, no autograd graph
    HEAD = "head"  # final norm + lm_head + loss, forward and backward fused, one micro-batch
    BWD = "bwd"  # one pack x one backward micro-batch: recompute from the stash, then backward
    EMBED_BWD = "embed_bwd"  # embedding backward over the whole batch
    DOWNLOAD = "download"  # a layer's accumulated gradients -> host, chunk by chunk
    UPDATE = "update"  # AdamW on the host as the gradient chunks arrive (streams from its DOWNLOAD)


#: Kinds whose dependencies only need to have *started*: an UPDATE consumes its DOWNLOAD's chunks
#: as they land (through a bounded pool), so waiting for the whole download would deadlock.
STREAMING_KINDS = frozenset({Kind.UPDATE})

COMPUTE_KINDS = frozenset({Kind.EMBED_FWD, Kind.FWD, Kind.HEAD, Kind.BWD, Kind.EMBED_BWD})


def lane_name(kind: Kind, device: int) -> str:
    if kind is Kind.UPDATE:
        return "host:optimizer"
    if kind in (Kind.UPLOAD, Kind.RESIDENT_UPLOAD):
        return f"dev{device}:h2d"
    if kind is Kind.DOWNLOAD:
        return f"dev{device}:d2h"
    return f"dev{device}:compute"


@dataclass(frozen=True)
class Task:
    """One unit of work on one lane. ``deps`` name tasks that must complete first."""

    id: str
    kind: Kind
    device: int
    layers: tuple[int, ...] = ()
    pack: int = -1
    mb: int = -1
    rows: tuple[int, int] = (0, 0)
    slots: tuple[int | None, ...] = ()  # None: the layer's resident buffer (a resident pack)
    grad_slots: tuple[int | None, ...] = ()
    first: bool = False
    last: bool = False
    deps: tuple[str, ...] = ()

    @property
    def lane(self) -> str:
        return lane_name(self.kind, self.device)


@dataclass
class Schedule:
    """All tasks of one optimizer step, grouped into lanes executed in list order."""

    plan: Plan
    batch: int
    num_layers: int  # embedding + blocks + head
    tasks: dict[str, Task] = field(default_factory=dict)
    lanes: dict[str, list[str]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # a global order consistent with all deps
    _upload_ranks: dict[int, int] | None = field(default=None, init=False, repr=False, compare=False)

    def upload_order(self) -> dict[int, int]:
        """Layer -> rank of its first upload in :attr:`order` (what a step needs first); computed
        once per schedule (the engine asks every step)."""
        if self._upload_ranks is None:
            ranks: dict[int, int] = {}
            for tid in self.order:
                t = self.tasks[tid]
                if t.kind in (Kind.UPLOAD, Kind.RESIDENT_UPLOAD) and t.layers[0] not in ranks:
                    ranks[t.layers[0]] = len(ranks)
            self._upload_ranks = ranks
        return self._upload_ranks

    def add(self, task: Task) -> Task:
        if task.id in self.tasks:
            raise ValueError(f"duplicate task id {task.id}")
        self.tasks[task.id] = task
        self.lanes.setdefault(task.lane, []).append(task.id)
        self.order.append(task.id)
        self._upload_ranks = None
        return task

    def fwd_rows(self) -> list[tuple[int, int]]:
        return _rows(self.batch, self.plan.micro_batch_size)

    def bwd_rows(self) -> list[tuple[int, int]]:
        return _rows(self.batch, self.plan.backward_micro_batch_size)


def _rows(batch: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(batch, lo + size)) for lo in range(0, batch, size)]
