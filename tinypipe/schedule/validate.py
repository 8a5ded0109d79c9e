"""Check a schedule without running it: dependencies exist, lanes cannot deadlock, no slot is
overwritten while its previous occupant may still be in use, and a pack that keeps its forward's
autograd graph (``Plan.keep_activations``) finds the same weights (in its backward's buffers) in its
backward."""

from __future__ import annotations

from tinypipe.errors import ConfigError
from tinypipe.schedule.ids import Kind, TaskId, resident_upload_id
from tinypipe.schedule.tasks import STREAMING_KINDS, Schedule


def validate(sched: Schedule) -> None:
    """Raise ConfigError naming the first problem found."""
    tasks = sched.tasks
    for t in tasks.values():
        for d in t.deps:
            if d not in tasks:
                raise ConfigError(f"schedule: task {t.id} depends on unknown task {d}")
    _check_no_deadlock(sched)
    _check_slots(sched)
    _check_kept(sched)


def _check_no_deadlock(sched: Schedule) -> None:
    """Simulate the lanes: each runs its list in order, a task only once all deps have run."""
    heads = {lane: 0 for lane in sched.lanes}
    done: set[TaskId] = set()
    started: set[TaskId] = set()  # at the head of its lane with all deps done
    remaining = len(sched.tasks)
    while remaining:
        progressed = False
        for lane, ids in sched.lanes.items():
            if heads[lane] < len(ids):
                t = sched.tasks[ids[heads[lane]]]
                if all(d in done for d in t.deps):
                    started.add(t.id)
        for lane, ids in sched.lanes.items():
            while heads[lane] < len(ids):
                t = sched.tasks[ids[heads[lane]]]
                need = started if t.kind in STREAMING_KINDS else done
                if not all(d in need or d in done for d in t.deps):
                    break
                done.add(t.id)
                heads[lane] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = []
            for lane, ids in sched.lanes.items():
                if heads[lane] < len(ids):
                    t = sched.tasks[ids[heads[lane]]]
                    stuck.append(f"{lane}:{t.id} waits for {[str(d) for d in t.deps if d not in done]}")
            raise ConfigError("schedule deadlocks: " + "; ".join(stuck))


def _check_slots(sched: Schedule) -> None:
    """Every upload into a slot must depend on the last task that used the slot's previous layer,
    and every compute task must depend (directly or via an earlier task of its pack) on the
    uploads of its layers."""
    last_user: dict[tuple[int, int], TaskId] = {}
    occupant: dict[tuple[int, int], int] = {}
    loader: dict[tuple[int, int], TaskId] = {}  # (device, slot) -> the upload that filled it
    for tid in sched.order:
        t = sched.tasks[tid]
        if t.kind is Kind.UPLOAD:
            key = (t.device, t.slots[0])
            if key in last_user and last_user[key] not in t.deps:
                raise ConfigError(f"schedule: {t.id} overwrites slot {key} before {last_user[key]} finished")
            occupant[key] = t.layers[0]
            loader[key] = t.id
            last_user.pop(key, None)
        elif t.kind in (Kind.FWD, Kind.BWD):
            for layer, slot in zip(t.layers, t.slots):
                if slot is None:  # a resident layer: its forward must wait for the one-time load
                    load = resident_upload_id(layer)
                    if t.kind is Kind.FWD and t.first and load not in t.deps:
                        raise ConfigError(f"schedule: {t.id} uses resident layer {layer} without waiting "
                                          f"for {load}")
                    continue
                key = (t.device, slot)
                if occupant.get(key) != layer:
                    raise ConfigError(f"schedule: {t.id} expects layer {layer} in slot {key}, "
                                      f"holds {occupant.get(key)}")
                # the first task using a freshly uploaded slot must wait for that upload (later
                # tasks follow it in lane order; a carried slot was waited for by its first user)
                if key not in last_user and loader.get(key) not in t.deps:
                    raise ConfigError(f"schedule: {t.id} uses slot {key} without waiting for "
                                      f"{loader.get(key)}")
                last_user[key] = t.id
    grad_user: dict[tuple[int, int], TaskId] = {}
    for tid in sched.order:
        t = sched.tasks[tid]
        if t.kind is Kind.BWD and t.first:
            for g in t.grad_slots:
                if g is None:
                    continue
                key = (t.device, g)
                if key in grad_user and grad_user[key] not in t.deps:
                    raise ConfigError(f"schedule: {t.id} reuses gradient slot {key} before {grad_user[key]}")
        elif t.kind is Kind.DOWNLOAD and t.grad_slots:
            grad_user[(t.device, t.grad_slots[0])] = t.id


def _check_kept(sched: Schedule) -> None:
    """A kept pack's backward differentiates the graph its forward recorded. The graph saved the
    pack's weights by reference (runtime/weight_refs.py) and re-reads them from the backward's
    buffers, which the slot checks prove hold the pack's layers; the activations it saved are the
    forward's. Proven here: forward and backward on one device (the graph lives there), nothing
    loaded into or updated of those layers' resident buffers and no update of the layers between
    the pack's first forward and its last backward in the step's order (the weights the backward
    re-reads are the ones the forward used), and every backward task covering whole forward
    micro-batches (a graph is differentiated once)."""
    plan = sched.plan
    kept = [q for q in range(plan.num_packs) if plan.kept(q)]
    if not kept:
        return
    tasks = sched.tasks
    frows = sched.fwd_rows()
    bounds = {a for a, _ in frows} | {b for _, b in frows}
    pos = {tid: i for i, tid in enumerate(sched.order)}
    for q in kept:
        fwds = [t for t in tasks.values() if t.kind is Kind.FWD and t.pack == q]
        bwds = [t for t in tasks.values() if t.kind is Kind.BWD and t.pack == q]
        if not fwds or not bwds:
            raise ConfigError(f"schedule: kept pack {q} lacks its forward or backward tasks")
        devices = {t.device for t in fwds + bwds}
        if len(devices) != 1:
            raise ConfigError(f"schedule: kept pack {q} runs on devices {sorted(devices)}; "
                              "its graph lives on one")
        for t in bwds:
            if t.rows[0] not in bounds or t.rows[1] not in bounds:
                raise ConfigError(f"schedule: {t.id} of kept pack {q} splits a forward micro-batch "
                                  f"(rows {t.rows[0]}:{t.rows[1]})")
        layers = set(fwds[0].layers)
        start = min(pos[t.id] for t in fwds)
        end = max(pos[t.id] for t in bwds)
        for tid in sched.order[start + 1 : end]:
            t = tasks[tid]
            if t.kind in (Kind.RESIDENT_UPLOAD, Kind.UPDATE) and set(t.layers) & layers:
                raise ConfigError(f"schedule: {t.id} changes layer {t.layers[0]} between the forward and the "
                                  f"backward of kept pack {q}")