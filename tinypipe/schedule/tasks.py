"""Tasks and schedules: what runs where, in which order, after what (kinds, task ids and lanes:
:mod:`tinypipe.schedule.ids`). A schedule is keyed by :class:`TaskId` and :class:`Lane`, never by
their text: ``str()`` makes the text where it is shown (traces, dumps, messages)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tinypipe.schedule.ids import Kind, Lane, TaskId, lane_of
from tinypipe.schedule.plan import Plan

#: Kinds whose dependencies only need to have *started*: an UPDATE consumes its DOWNLOAD's chunks
#: as they land (through a bounded pool), so waiting for the whole download would deadlock.
STREAMING_KINDS = frozenset({Kind.UPDATE})

COMPUTE_KINDS = frozenset({Kind.EMBED_FWD, Kind.FWD, Kind.HEAD, Kind.BWD, Kind.EMBED_BWD})


@dataclass(frozen=True)
class Task:
    """One unit of work on one lane. ``deps`` name tasks that must complete first; ids are built
    by :mod:`tinypipe.schedule.ids`."""

    id: TaskId
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
    deps: tuple[TaskId, ...] = ()

    @property
    def lane(self) -> Lane:
        return lane_of(self.kind, self.device)


@dataclass
class Schedule:
    """All tasks of one optimizer step, grouped into lanes executed in list order."""

    plan: Plan
    batch: int
    num_layers: int  # embedding + blocks + head
    tasks: dict[TaskId, Task] = field(default_factory=dict)
    lanes: dict[Lane, list[TaskId]] = field(default_factory=dict)
    order: list[TaskId] = field(default_factory=list)  # a global order consistent with all deps
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
        """Append ``task`` to its lane and the global order. A text id (``"fwd/0/0"``) is refused:
        it would never equal the :class:`TaskId` the rest of the step looks up."""
        if type(task.id) is not TaskId or not all(type(d) is TaskId for d in task.deps):
            raise TypeError(f"task {task.id!r}: ids and deps must be TaskId (tinypipe.schedule.ids), "
                            f"not text; deps {task.deps!r}")
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
