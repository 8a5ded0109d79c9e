"""Turn a :class:`Plan` into a :class:`Schedule` for one optimizer step.

Layer indices: 0 is the embedding, 1..L the blocks, L+1 the head. The builder walks the step in
a global order (embedding forward; each pack's forward over all micro-batches; the head; each
pack's backward in reverse; the embedding backward) and assigns every task to its lane. With a
micro-batch-wise turn (``Plan.turn_packs``) the last packs' forwards, the head and those packs'
backwards run per forward micro-batch instead, between the other packs' forwards and backwards. A pack
that keeps its activations (``Plan.keep_activations``) has the same tasks; its backward waits
for the forward graphs of its rows instead of the stash. Slots are
assigned statically: an upload takes the slot whose previous occupant was released earliest and
depends on the task that released it, so lanes can run ahead freely and a validator can check the
whole step without running it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tinypipe.errors import ConfigError
from tinypipe.schedule.plan import Plan
from tinypipe.schedule.ids import (
    EMBED_BWD_ID,
    EMBED_FWD_ID,
    HEAD,
    Kind,
    Phase,
    TaskId,
    bwd_id,
    download_id,
    fwd_id,
    head_id,
    reduce_id,
    resident_upload_id,
    update_id,
    upload_id,
)
from tinypipe.schedule.tasks import Schedule, Task
from tinypipe.schedule.transient_grads import transient_grad_layers


@dataclass
class _SlotRing:
    """Static slot assignment on one device: free slots, then earliest-released slots."""

    count: int
    free: deque[int] = field(default_factory=deque)
    pending: deque[tuple[int, TaskId]] = field(default_factory=deque)  # (slot, releasing task), in order

    def __post_init__(self) -> None:
        self.free = deque(range(self.count))

    def acquire(self, what: str) -> tuple[int, TaskId | None]:
        if self.free:
            return self.free.popleft(), None
        if not self.pending:
            raise ConfigError(f"schedule needs more slots than {self.count} for {what}")
        return self.pending.popleft()

    def release(self, slot: int | None, task_id: TaskId) -> None:
        if slot is not None:  # None: a resident layer's own buffer, not a ring slot
            self.pending.append((slot, task_id))


def _overlapping(rows: list[tuple[int, int]], lo: int, hi: int) -> list[int]:
    return [i for i, (a, b) in enumerate(rows) if a < hi and b > lo]


def build_schedule(plan: Plan, batch: int, tied: bool, reduce: bool = False,
                   long_sequences: bool = False) -> Schedule:
    """The full step for a global batch of ``batch`` sequences. Each layer's gradient is reduced
    across replicas (a REDUCE task before its download) when ``plan.replicas > 1`` or ``reduce``
    (the engine joined a process group of one rank: the same collectives, each an identity).
    ``long_sequences`` (the MLPs run in chunks): the first backward waits for the head's gradient
    download when that accumulator is transient (:mod:`~tinypipe.schedule.transient_grads`)."""
    return _Builder(plan, batch, tied, reduce, long_sequences).build()


class _Builder:
    """One schedule's construction, in the step's global order (one method per phase)."""

    def __init__(self, plan: Plan, batch: int, tied: bool, reduce: bool = False,
                 long_sequences: bool = False) -> None:
        if batch < 1:
            raise ConfigError("global batch must hold at least one sequence")
        if tied and plan.head_device != plan.embed_device:
            raise ConfigError("tied embeddings need the head on the embedding's device")
        for q, pack in enumerate(plan.packs):
            if not pack:
                raise ConfigError(f"pack {q} is empty")
        self.plan, self.batch, self.tied = plan, batch, tied
        self.reduce = reduce or plan.replicas > 1
        self.P = plan.num_packs
        self.H = plan.num_blocks + 1  # layer 0 is the embedding, 1..L the blocks
        # the first R packs never leave their device (loaded once, stepped there)
        self.R = plan.resident_packs
        self.sched = Schedule(plan=plan, batch=batch, num_layers=plan.num_blocks + 2)
        self.frows, self.brows = self.sched.fwd_rows(), self.sched.bwd_rows()
        self.param_rings = {d: _SlotRing(plan.param_slots()) for d in range(plan.num_devices)}
        self.grad_rings = {d: _SlotRing(plan.grad_slot_count()) for d in range(plan.num_devices)}
        # The first pack of the micro-batch-wise turn (Plan.turn_packs; P: none). Its packs keep
        # their slots from forward to backward; without a turn the last forward pack and the first
        # backward pack do, when both run on one device back to back.
        self.T = self.P - plan.turn_packs
        self.carry = plan.fwd_device[self.P - 1] == plan.bwd_device[self.P - 1] and self.T == self.P
        self.fwd_slots: dict[int, tuple[int | None, ...]] = {}
        self.fwd_uploads: dict[int, list[TaskId]] = {}
        self.last_head = head_id(len(self.frows) - 1)
        # the head's gradient leaves the device before the first block backward allocates
        self.head_grad_first = plan.num_blocks + 1 in transient_grad_layers(plan, tied, long_sequences)

    def build(self) -> Schedule:
        self._resident_uploads()
        self._forward()
        if self.T < self.P:
            self._turn()
        else:
            self._head()
        for q in reversed(range(self.T)):
            self._backward(q)
        self._embedding_backward()
        return self.sched

    def _add(self, task: Task) -> None:
        self.sched.add(task)

    def _layers(self, q: int) -> tuple[int, ...]:
        return tuple(b + 1 for b in self.plan.packs[q])

    def _resident_uploads(self) -> None:
        """The embedding's and the resident packs' one-time loads, then the embedding forward."""
        e_dev = self.plan.embed_device
        self._add(Task(resident_upload_id(0), Kind.RESIDENT_UPLOAD, e_dev, layers=(0,)))
        for q in range(self.R):
            for layer in self._layers(q):
                self._add(Task(resident_upload_id(layer), Kind.RESIDENT_UPLOAD, self.plan.fwd_device[q],
                               layers=(layer,)))
        self._add(Task(EMBED_FWD_ID, Kind.EMBED_FWD, e_dev, layers=(0,), rows=(0, self.batch),
                       deps=(resident_upload_id(0),)))

    def _uploads(self, q: int, device: int, phase: Phase) -> tuple[tuple[int | None, ...], list[TaskId]]:
        """Slots and upload task ids of pack ``q`` for one pass."""
        if q < self.R:  # resident: no slot; the forward waits for the one-time load
            loads = [resident_upload_id(layer) for layer in self._layers(q)] if phase == "f" else []
            return (None,) * len(self.plan.packs[q]), loads
        slots: list[int | None] = []
        ids: list[TaskId] = []
        for layer in self._layers(q):
            slot, dep = self.param_rings[device].acquire(f"layer {layer}")
            tid = upload_id(phase, q, layer)
            self._add(Task(tid, Kind.UPLOAD, device, layers=(layer,), pack=q, slots=(slot,),
                           deps=(dep,) if dep is not None else ()))
            slots.append(slot)
            ids.append(tid)
        return tuple(slots), ids

    def _forward(self) -> None:
        """Each pack's forward over all micro-batches, up to the turn (the turn's packs: their uploads)."""
        for q in range(self.P):
            dev = self.plan.fwd_device[q]
            slots, up_ids = self._uploads(q, dev, "f")
            self.fwd_slots[q] = slots
            self.fwd_uploads[q] = up_ids
            if q == 0:
                # the head's upload: behind the first pack's (which the forward waits for first) and
                # ahead of the rest, a whole forward before the head needs it
                self._add(Task(resident_upload_id(HEAD), Kind.RESIDENT_UPLOAD, self.plan.head_device,
                               layers=(self.H,)))
            if q >= self.T:  # the turn's packs run their micro-batches in the turn
                continue
            for m in range(len(self.frows)):
                self._add_fwd(q, m)
            if not (self.carry and q == self.P - 1):
                for s in slots:
                    self.param_rings[dev].release(s, fwd_id(q, len(self.frows) - 1))

    def _add_fwd(self, q: int, m: int) -> None:
        lo, hi = self.frows[m]
        deps = [EMBED_FWD_ID] + (self.fwd_uploads[q] if m == 0 else [])
        deps.append(EMBED_FWD_ID if q == 0 else fwd_id(q - 1, m))
        self._add(Task(fwd_id(q, m), Kind.FWD, self.plan.fwd_device[q], layers=self._layers(q), pack=q, mb=m,
                       rows=(lo, hi), slots=self.fwd_slots[q], first=m == 0, last=m == len(self.frows) - 1,
                       deps=tuple(dict.fromkeys(deps))))

    def _turn(self) -> None:
        """The micro-batch-wise turn (``Plan.turn_packs``): per forward micro-batch, the turn's
        packs forward, the head, the turn's packs backward in reverse, differentiating that
        micro-batch's graphs at once -- so each pack holds one micro-batch's graph, not the step's.
        Their weights stay in the forward's slots throughout; their gradient slots are taken up
        front and their layers download once the last micro-batch is through."""
        turn = range(self.T, self.P)
        dev = self.plan.head_device
        gslots = {q: self._grad_slots(q, dev) for q in reversed(turn)}
        for m, (lo, hi) in enumerate(self.frows):
            for q in turn:
                self._add_fwd(q, m)
            self._add_head(m)
            for q in reversed(turn):
                deps = [EMBED_FWD_ID] + (gslots[q][1] if m == 0 else [])
                deps.append(head_id(m) if q == self.P - 1 else bwd_id(q + 1, m))
                deps.append(fwd_id(q, m))  # its graph
                self._add(Task(bwd_id(q, m), Kind.BWD, dev, layers=self._layers(q), pack=q, mb=m,
                               rows=(lo, hi), slots=self.fwd_slots[q], grad_slots=tuple(gslots[q][0]),
                               first=m == 0, last=m == len(self.frows) - 1, deps=tuple(dict.fromkeys(deps))))
        self._download_and_update(self.H, dev, None, self.last_head)
        for q in reversed(turn):
            last_bwd = bwd_id(q, len(self.frows) - 1)
            for s in self.fwd_slots[q]:
                self.param_rings[dev].release(s, last_bwd)
            for layer, g in zip(self._layers(q), gslots[q][0]):
                self._download_and_update(layer, dev, g, last_bwd)

    def _head(self) -> None:
        """Final norm + LM head + loss, forward and backward fused, per forward micro-batch."""
        for m in range(len(self.frows)):
            self._add_head(m)
        self._download_and_update(self.H, self.plan.head_device, None, self.last_head)

    def _add_head(self, m: int) -> None:
        lo, hi = self.frows[m]
        deps = [fwd_id(self.P - 1, m), resident_upload_id(HEAD)]
        if self.tied:  # the head borrows the embedding's weight
            deps.append(resident_upload_id(0))
        self._add(Task(head_id(m), Kind.HEAD, self.plan.head_device, layers=(self.H,), mb=m, rows=(lo, hi),
                       first=m == 0, last=m == len(self.frows) - 1, deps=tuple(deps)))

    def _download_and_update(self, layer: int, device: int, grad_slot: int | None, after: TaskId) -> None:
        dl = download_id(layer)
        slots = (grad_slot,) if grad_slot is not None else ()
        if self.reduce:  # summed across the replicas first; the download waits for it
            self._add(Task(reduce_id(layer), Kind.REDUCE, device, layers=(layer,), grad_slots=slots,
                           deps=(after,)))
            after = reduce_id(layer)
        self._add(Task(dl, Kind.DOWNLOAD, device, layers=(layer,), grad_slots=slots, deps=(after,)))
        self.grad_rings[device].release(grad_slot, dl)
        self._add(Task(update_id(layer), Kind.UPDATE, -1, layers=(layer,), deps=(dl,)))

    def _grad_slots(self, q: int, device: int) -> tuple[list[int | None], list[TaskId]]:
        """Gradient slots of pack ``q``'s layers and the downloads they wait for."""
        gslots: list[int | None] = []
        gdeps: list[TaskId] = []
        for layer in self._layers(q):
            if q < self.R:  # a resident layer accumulates into its own resident gradient buffer
                gslots.append(None)
                continue
            g, dep = self.grad_rings[device].acquire(f"gradients of layer {layer}")
            gslots.append(g)
            if dep is not None:
                gdeps.append(dep)
        return gslots, gdeps

    def _backward_deps(self, q: int, n: int, first_deps: list[TaskId]) -> list[TaskId]:
        lo, hi = self.brows[n]
        deps = [EMBED_FWD_ID] + (first_deps if n == 0 else [])
        if q == self.P - 1:
            deps += [head_id(m) for m in _overlapping(self.frows, lo, hi)]
            if n == 0 and self.head_grad_first:
                deps.append(download_id(self.H))
        elif q + 1 == self.T and self.T < self.P:  # after the turn, whose backward ran the forward's rows
            deps += [bwd_id(q + 1, m) for m in _overlapping(self.frows, lo, hi)]
        else:
            deps.append(bwd_id(q + 1, n))
        if self.plan.kept(q):  # no stash read: the graphs this pack's forward kept for these rows
            deps += [fwd_id(q, m) for m in _overlapping(self.frows, lo, hi)]
        elif q > 0:  # the stashed input: the previous pack's forward of the overlapping rows
            deps += [fwd_id(q - 1, m) for m in _overlapping(self.frows, lo, hi)]
        if n == 0 and self.carry and q == self.P - 1:
            deps.append(fwd_id(q, len(self.frows) - 1))
        return deps

    def _backward(self, q: int) -> None:
        """Pack ``q``'s backward micro-batches, then its layers' downloads and updates."""
        dev = self.plan.bwd_device[q]
        if self.carry and q == self.P - 1:
            slots, up_ids = self.fwd_slots[q], []
        else:
            slots, up_ids = self._uploads(q, dev, "b")
        gslots, gdeps = self._grad_slots(q, dev)
        brows = self.brows
        for n, (lo, hi) in enumerate(brows):
            deps = self._backward_deps(q, n, up_ids + gdeps)
            self._add(Task(bwd_id(q, n), Kind.BWD, dev, layers=self._layers(q), pack=q, mb=n, rows=(lo, hi),
                           slots=slots, grad_slots=tuple(gslots), first=n == 0, last=n == len(brows) - 1,
                           deps=tuple(dict.fromkeys(deps))))
        last_bwd = bwd_id(q, len(brows) - 1)
        for s in slots:
            self.param_rings[dev].release(s, last_bwd)
        for layer, g in zip(self._layers(q), gslots):
            self._download_and_update(layer, dev, g, last_bwd)

    def _embedding_backward(self) -> None:
        e_dev = self.plan.embed_device
        rows = self.frows if self.T == 0 else self.brows  # a turn through every pack: the forward's rows
        deps = [bwd_id(0, n) for n in range(len(rows))] + ([self.last_head] if self.tied else [])
        self._add(Task(EMBED_BWD_ID, Kind.EMBED_BWD, e_dev, layers=(0,), rows=(0, self.batch),
                       deps=tuple(deps)))
        self._download_and_update(0, e_dev, None, EMBED_BWD_ID)
