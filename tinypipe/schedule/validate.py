"""Check a schedule without running it: dependencies exist, lanes cannot deadlock, and no slot is
overwritten while its previous occupant may still be in use."""

from __future__ import annotations

from tinypipe.errors import ConfigError
from tinypipe.schedule.ids import Kind, resident_upload_id
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


def _check_no_deadlock(sched: Schedule) -> None:
    """Simulate the lanes: each runs its list in order, a task only once all deps have run."""
    heads = {lane: 0 for lane in sched.lanes}
    done: set[str] = set()
    started: set[str] = set()  # at the head of its lane with all deps done
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
                    stuck.append(f"{lane}:{t.id} waits for {[d for d in t.deps if d not in done]}")
            raise ConfigError("schedule deadlocks: " + "; ".join(stuck))


def _check_slots(sched: Schedule) -> None:
    """Every upload into a slot must depend on the last task that used the slot's previous layer,
    and every compute task must depend (directly or via an earlier task of its pack) on the
    uploads of its layers."""
    last_user: dict[tuple[int, int], str] = {}
    occupant: dict[tuple[int, int], int] = {}
    loader: dict[tuple[int, int], str] = {}  # (device, slot) -> the upload that filled it
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
    grad_user: dict[tuple[int, int], str] = {}
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
