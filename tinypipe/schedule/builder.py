"""Turn a :class:`Plan` into a :class:`Schedule` for one optimizer step.

Layer indices: 0 is the embedding, 1..L the blocks, L+1 the head. The builder walks the step in
a global order (embedding forward; each pack's forward over all micro-batches; the head; each
pack's backward in reverse; the embedding backward) and assigns every task to its lane. Slots are
assigned statically: an upload takes the slot whose previous occupant was released earliest and
depends on the task that released it, so lanes can run ahead freely and a validator can check the
whole step without running it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tinypipe.errors import ConfigError
from tinypipe.schedule.plan import Plan
from tinypipe.schedule.tasks import Kind, Schedule, Task


@dataclass
class _SlotRing:
    """Static slot assignment on one device: free slots, then earliest-released slots."""

    count: int
    free: deque = field(default_factory=deque)
    pending: deque = field(default_factory=deque)  # (slot, releasing task id), in release order

    def __post_init__(self) -> None:
        self.free = deque(range(self.count))

    def acquire(self, what: str) -> tuple[int, str | None]:
        if self.free:
            return self.free.popleft(), None
        if not self.pending:
            raise ConfigError(f"schedule needs more slots than {self.count} for {what}")
        return self.pending.popleft()

    def release(self, slot: int | None, task_id: str) -> None:
        if slot is not None:  # None: a resident layer's own buffer, not a ring slot
            self.pending.append((slot, task_id))


def _overlapping(rows: list[tuple[int, int]], lo: int, hi: int) -> list[int]:
    return [i for i, (a, b) in enumerate(rows) if a < hi and b > lo]


def build_schedule(plan: Plan, batch: int, tied: bool) -> Schedule:
    """The full step for a global batch of ``batch`` sequences."""
    if batch < 1:
        raise ConfigError("global batch must hold at least one sequence")
    L = plan.num_blocks
    P = plan.num_packs
    E, H = 0, L + 1
    if tied and plan.head_device != plan.embed_device:
        raise ConfigError("tied embeddings need the head on the embedding's device")
    for q, pack in enumerate(plan.packs):
        if not pack:
            raise ConfigError(f"pack {q} is empty")
    sched = Schedule(plan=plan, batch=batch, num_layers=L + 2)
    frows, brows = sched.fwd_rows(), sched.bwd_rows()
    param_rings = {d: _SlotRing(plan.param_slots()) for d in range(plan.num_devices)}
    grad_rings = {d: _SlotRing(plan.grad_slot_count()) for d in range(plan.num_devices)}
    e_dev, h_dev = plan.embed_device, plan.head_device

    def layers_of(q: int) -> tuple[int, ...]:
        return tuple(b + 1 for b in plan.packs[q])

    # Which forward executions keep their slots for the backward of the same pack: the last
    # forward pack and the first backward pack when both run on one device back to back.
    carry = plan.fwd_device[P - 1] == plan.bwd_device[P - 1]

    R = plan.resident_packs  # the first R packs never leave their device (loaded once, stepped there)
    sched.add(Task("ru/E", Kind.RESIDENT_UPLOAD, e_dev, layers=(E,)))
    for q in range(R):
        for layer in layers_of(q):
            sched.add(Task(f"ru/L{layer}", Kind.RESIDENT_UPLOAD, plan.fwd_device[q], layers=(layer,)))
    sched.add(Task("efwd", Kind.EMBED_FWD, e_dev, layers=(E,), rows=(0, batch), deps=("ru/E",)))

    fwd_slots: dict[int, tuple[int | None, ...]] = {}

    def uploads(q: int, device: int, tag: str) -> tuple[tuple[int | None, ...], list[str]]:
        if q < R:  # resident: no slot; the forward waits for the one-time load
            return (None,) * len(plan.packs[q]), [f"ru/L{layer}" for layer in layers_of(q)] if tag[0] == "f" else []
        slots, ids = [], []
        for layer in layers_of(q):
            slot, dep = param_rings[device].acquire(f"layer {layer}")
            tid = f"up/{tag}/L{layer}"
            sched.add(Task(tid, Kind.UPLOAD, device, layers=(layer,), slots=(slot,), deps=(dep,) if dep else ()))
            slots.append(slot)
            ids.append(tid)
        return tuple(slots), ids

    # ---- forward -----------------------------------------------------------------------
    for q in range(P):
        dev = plan.fwd_device[q]
        slots, up_ids = uploads(q, dev, f"f{q}")
        fwd_slots[q] = slots
        if q == 0:
            # the head's upload: behind the first pack's (which the forward waits for first) and
            # ahead of the rest, a whole forward before the head needs it
            sched.add(Task("ru/H", Kind.RESIDENT_UPLOAD, h_dev, layers=(H,)))
        for m, (lo, hi) in enumerate(frows):
            deps = ["efwd"] + (up_ids if m == 0 else [])
            deps.append("efwd" if q == 0 else f"fwd/{q - 1}/{m}")
            last = m == len(frows) - 1
            sched.add(Task(f"fwd/{q}/{m}", Kind.FWD, dev, layers=layers_of(q), pack=q, mb=m, rows=(lo, hi),
                           slots=slots, first=m == 0, last=last, deps=tuple(dict.fromkeys(deps))))
        if not (carry and q == P - 1):
            for s in slots:
                param_rings[dev].release(s, f"fwd/{q}/{len(frows) - 1}")

    # ---- head (forward + backward fused) ------------------------------------------------
    for m, (lo, hi) in enumerate(frows):
        deps = [f"fwd/{P - 1}/{m}", "ru/H"] + (["ru/E"] if tied else [])
        sched.add(Task(f"head/{m}", Kind.HEAD, h_dev, layers=(H,), mb=m, rows=(lo, hi), first=m == 0,
                       last=m == len(frows) - 1, deps=tuple(deps)))
    last_head = f"head/{len(frows) - 1}"
    sched.add(Task("dl/L%d" % H, Kind.DOWNLOAD, h_dev, layers=(H,), deps=(last_head,)))
    sched.add(Task("upd/L%d" % H, Kind.UPDATE, -1, layers=(H,), deps=("dl/L%d" % H,)))

    # ---- backward -----------------------------------------------------------------------
    for q in reversed(range(P)):
        dev = plan.bwd_device[q]
        if carry and q == P - 1:
            slots, up_ids = fwd_slots[q], []
        else:
            slots, up_ids = uploads(q, dev, f"b{q}")
        gslots: list[int | None] = []
        gdeps = []
        for layer in layers_of(q):
            if q < R:  # a resident layer accumulates into its own resident gradient buffer
                gslots.append(None)
                continue
            g, dep = grad_rings[dev].acquire(f"gradients of layer {layer}")
            gslots.append(g)
            if dep:
                gdeps.append(dep)
        for n, (lo, hi) in enumerate(brows):
            deps = ["efwd"] + (up_ids + gdeps if n == 0 else [])
            if q == P - 1:
                deps += [f"head/{m}" for m in _overlapping(frows, lo, hi)]
            else:
                deps.append(f"bwd/{q + 1}/{n}")
            if q > 0:
                deps += [f"fwd/{q - 1}/{m}" for m in _overlapping(frows, lo, hi)]
            if n == 0 and carry and q == P - 1:
                deps.append(f"fwd/{q}/{len(frows) - 1}")
            sched.add(Task(f"bwd/{q}/{n}", Kind.BWD, dev, layers=layers_of(q), pack=q, mb=n, rows=(lo, hi),
                           slots=slots, grad_slots=tuple(gslots), first=n == 0, last=n == len(brows) - 1,
                           deps=tuple(dict.fromkeys(deps))))
        last_bwd = f"bwd/{q}/{len(brows) - 1}"
        for s in slots:
            param_rings[dev].release(s, last_bwd)
        for layer, g in zip(layers_of(q), gslots):
            dl = f"dl/L{layer}"
            sched.add(Task(dl, Kind.DOWNLOAD, dev, layers=(layer,), grad_slots=(g,) if g is not None else (),
                           deps=(last_bwd,)))
            grad_rings[dev].release(g, dl)
            sched.add(Task(f"upd/L{layer}", Kind.UPDATE, -1, layers=(layer,), deps=(dl,)))

    # ---- embedding backward ---------------------------------------------------------------
    deps = [f"bwd/0/{n}" for n in range(len(brows))] + ([last_head] if tied else [])
    sched.add(Task("ebwd", Kind.EMBED_BWD, e_dev, layers=(E,), rows=(0, batch), deps=tuple(deps)))
    sched.add(Task("dl/L0", Kind.DOWNLOAD, e_dev, layers=(E,), deps=("ebwd",)))
    sched.add(Task("upd/L0", Kind.UPDATE, -1, layers=(E,), deps=("dl/L0",)))
    return sched
