"""Schedules as data, without a model: the builder's output passes the validator over a grid of
plans, the validator rejects hand-corrupted schedules, placement is round-robin, plans round-trip
through JSON, schedules are keyed by typed ids whose text reads back to them."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest

import tinypipe
from tinypipe.schedule.builder import build_schedule
from tinypipe.schedule.ids import (
    EMBED_BWD_ID,
    EMBED_FWD_ID,
    HEAD,
    OPTIMIZER_LANE,
    Kind,
    Lane,
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
from tinypipe.schedule.plan import Plan, make_plan, round_robin_devices, split_packs
from tinypipe.schedule.render import to_text
from tinypipe.schedule.tasks import Schedule, Task
from tinypipe.schedule.validate import validate

BLOCKS = 6
PACKINGS = [1, 2, 3, 6, 4, [1, 3, 2], [4, 1, 1], [1, 1, 4], [2, 4]]  # 4: uniform with a smaller last pack
MICRO = [(1, 1), (2, 2), (2, 3), (3, 1), (5, 2), (7, 7)]  # (fwd, bwd); 7 > batch
BATCH = 5


def plan_for(devices: int, packing, fwd: int, bwd: int, window: int, tied: bool,
             stash: str = "device") -> Plan:
    return make_plan(BLOCKS, pack_size=packing, micro_batch_size=fwd, backward_micro_batch_size=bwd, num_devices=devices,
                     prefetch_window=window, stash=stash, tied=tied)


def check_structure(sched: Schedule, tied: bool) -> None:
    """Properties of a correct step beyond what the validator checks."""
    plan = sched.plan
    L, P = plan.num_blocks, plan.num_packs
    nf, nb = len(sched.fwd_rows()), len(sched.bwd_rows())
    kinds = Counter(t.kind for t in sched.tasks.values())
    assert kinds[Kind.FWD] == P * nf and kinds[Kind.BWD] == P * nb
    assert kinds[Kind.HEAD] == nf
    assert kinds[Kind.EMBED_FWD] == kinds[Kind.EMBED_BWD] == 1
    assert kinds[Kind.RESIDENT_UPLOAD] == 2
    # every layer (embedding, blocks, head) is downloaded and updated exactly once
    for kind in (Kind.DOWNLOAD, Kind.UPDATE):
        layers = sorted(t.layers[0] for t in sched.tasks.values() if t.kind is kind)
        assert layers == list(range(L + 2)), (kind, layers)
    # rows of the micro-batches tile the batch
    for rows in (sched.fwd_rows(), sched.bwd_rows()):
        assert rows[0][0] == 0 and rows[-1][1] == sched.batch
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    # lanes hold only their own tasks; the global order lists every task once
    for lane, ids in sched.lanes.items():
        assert all(sched.tasks[t].lane == lane for t in ids)
        assert Lane.parse(str(lane)) == lane
        assert all(lane.device == (None if t.kind is Kind.UPDATE else t.device)
                   for t in map(sched.tasks.__getitem__, ids))
    # every id is its task as data: built by schedule.ids, its text parsed back to the same id
    for t in sched.tasks.values():
        ref = TaskId.parse(str(t.id))
        assert ref == t.id and ref.kind is t.kind, t.id
        if ref.pack is not None:
            assert ref.pack == t.pack, t.id
        if ref.mb is not None:
            assert ref.mb == t.mb, t.id
        if ref.layer is not None:
            assert (L + 1 if ref.layer == HEAD else ref.layer) == t.layers[0], t.id
    assert set(sched.order) == set(sched.tasks) and len(set(sched.order)) == len(sched.order)
    assert len(sched.order) == len(sched.tasks)
    # slots within the configured counts; packs on their planned devices
    for t in sched.tasks.values():
        assert all(0 <= s < plan.param_slots() for s in t.slots)
        assert all(0 <= g < plan.grad_slot_count() for g in t.grad_slots)
        if t.kind is Kind.FWD:
            assert t.device == plan.fwd_device[t.pack]
        if t.kind is Kind.BWD:
            assert t.device == plan.bwd_device[t.pack]
    # every block of a pack is uploaded before the pack's forward and before its backward
    # (directly or through the pack's first task on that device)
    for t in sched.tasks.values():
        if t.kind in (Kind.FWD, Kind.BWD) and t.first:
            ups = {sched.tasks[d].layers[0] for d in t.deps if sched.tasks[d].kind is Kind.UPLOAD}
            same_device = plan.fwd_device[P - 1] == plan.bwd_device[P - 1]
            carried = t.kind is Kind.BWD and t.pack == P - 1 and same_device
            assert carried or ups == set(t.layers), (t.id, ups)
    if tied:
        assert plan.head_device == plan.embed_device


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("window", [0, 1, 2, 3])
@pytest.mark.parametrize("devices", [1, 2, 3, 4])
def test_builder_output_validates(devices: int, window: int, tied: bool) -> None:
    for packing, (fwd, bwd) in itertools.product(PACKINGS, MICRO):
        plan = plan_for(devices, packing, fwd, bwd, window, tied)
        for batch in (1, BATCH):
            sched = build_schedule(plan, batch, tied)
            validate(sched)
            check_structure(sched, tied)


@pytest.mark.parametrize("stash", ["device", "host"])
def test_explicit_plans_validate(stash: str) -> None:
    """Hand-written placements (not round-robin), extra gradient slots, host stashes."""
    packs = split_packs(BLOCKS, [2, 1, 3])
    for fwd_dev, bwd_dev in [((0, 0, 0), (0, 0, 0)), ((1, 0, 1), (0, 1, 0)), ((0, 1, 2), (2, 1, 0))]:
        for grad_slots in (None, 3, 5):
            plan = Plan(packs=packs, micro_batch_size=2, backward_micro_batch_size=3, num_devices=3, prefetch_window=1,
                        stash_on_host=(False, stash == "host", stash == "host", False), fwd_device=fwd_dev,
                        bwd_device=bwd_dev, embed_device=0, head_device=2, grad_slots=grad_slots)
            sched = build_schedule(plan, BATCH, tied=False)
            validate(sched)
            check_structure(sched, tied=False)


def test_builder_rejects_impossible_plans() -> None:
    plan = plan_for(2, 2, 2, 2, 1, tied=False)
    with pytest.raises(tinypipe.ConfigError, match="tied"):
        build_schedule(dataclasses.replace(plan, head_device=1, embed_device=0), BATCH, tied=True)
    with pytest.raises(tinypipe.ConfigError, match="at least one"):
        build_schedule(plan, 0, tied=False)
    few_grad_slots = dataclasses.replace(plan_for(1, 3, 2, 2, 1, tied=False), grad_slots=2)
    with pytest.raises(tinypipe.ConfigError, match="slots"):  # fewer gradient slots than a pack's layers
        build_schedule(few_grad_slots, BATCH, tied=False)


# ---------------------------------------------------------------------------------- corruption

def base_schedule(devices: int = 1, fwd_mb: int = 2) -> Schedule:
    """Layer-wise packs with a 1-layer window: every upload after the first two reuses a slot."""
    plan = plan_for(devices, 1, fwd_mb, 2, 1, tied=False)
    sched = build_schedule(plan, BATCH, tied=False)
    validate(sched)
    return sched


def replace_task(sched: Schedule, tid: TaskId, **changes: object) -> None:
    sched.tasks[tid] = dataclasses.replace(sched.tasks[tid], **changes)


def rejects(sched: Schedule, *needles: str | TaskId) -> str:
    """The validator's message: one line naming every needle (an id by its text)."""
    with pytest.raises(tinypipe.ConfigError) as info:
        validate(sched)
    msg = str(info.value)
    assert "\n" not in msg
    for n in needles:
        assert str(n) in msg, (n, msg)
    return msg


def test_validator_rejects_dependency_cycle() -> None:
    sched = base_schedule()
    first_up = next(t for t in sched.order if sched.tasks[t].kind is Kind.UPLOAD)
    replace_task(sched, first_up, deps=sched.tasks[first_up].deps + (update_id(0),))  # waits for the very end
    rejects(sched, "deadlock", first_up)


def test_validator_rejects_cross_lane_deadlock() -> None:
    """No cycle in the dependency graph, but lane order makes it unsatisfiable: the h2d lane's
    head-buffer upload waits for a forward that needs a later upload on the same lane."""
    sched = base_schedule()
    h2d, ru_head = Lane(0, "h2d"), resident_upload_id(HEAD)
    assert sched.lanes[h2d].index(ru_head) < sched.lanes[h2d].index(upload_id("f", 1, 2))
    replace_task(sched, ru_head, deps=(fwd_id(1, 0),))
    rejects(sched, "deadlock", "ru/H")


def test_validator_rejects_two_task_cycle() -> None:
    sched = base_schedule(devices=2)
    replace_task(sched, fwd_id(0, 0), deps=sched.tasks[fwd_id(0, 0)].deps + (fwd_id(1, 0),))
    rejects(sched, "deadlock", "fwd/0/0")


def reusing_upload(sched: Schedule) -> Task:
    tasks = (sched.tasks[t] for t in sched.order)
    return next(t for t in tasks if t.kind is Kind.UPLOAD and t.deps)


def test_validator_rejects_upload_without_release_dependency() -> None:
    sched = base_schedule()
    up = reusing_upload(sched)
    replace_task(sched, up.id, deps=())
    rejects(sched, up.id, "overwrites slot")


def test_validator_rejects_upload_after_only_an_earlier_user() -> None:
    """Depending on the slot's first user is not enough: a later micro-batch still reads it."""
    sched = base_schedule(fwd_mb=2)  # 3 forward micro-batches
    up = reusing_upload(sched)
    (releaser,) = up.deps
    assert releaser.mb is not None and releaser.mb > 0
    replace_task(sched, up.id, deps=(releaser._replace(mb=0),))
    rejects(sched, up.id, "overwrites slot", releaser)


def test_validator_rejects_gradient_slot_reuse_without_dependency() -> None:
    sched = base_schedule()
    bwd = next(sched.tasks[t] for t in sched.order
               if sched.tasks[t].kind is Kind.BWD and sched.tasks[t].first
               and any(sched.tasks[d].kind is Kind.DOWNLOAD for d in sched.tasks[t].deps))
    replace_task(sched, bwd.id, deps=tuple(d for d in bwd.deps if sched.tasks[d].kind is not Kind.DOWNLOAD))
    rejects(sched, bwd.id, "gradient slot")


def test_validator_rejects_wrong_layer_in_slot() -> None:
    sched = base_schedule()
    fwd = sched.tasks[fwd_id(1, 0)]
    other = 1 - fwd.slots[0]
    for tid in [t for t in sched.order if sched.tasks[t].kind is Kind.FWD and sched.tasks[t].pack == 1]:
        replace_task(sched, tid, slots=(other,))
    rejects(sched, "fwd/1/0", "expects layer")


def test_validator_rejects_unknown_dependency() -> None:
    sched = base_schedule()
    replace_task(sched, head_id(0), deps=sched.tasks[head_id(0)].deps + (fwd_id(9, 9),))
    rejects(sched, "head/0", "unknown task fwd/9/9")


def test_validator_rejects_compute_without_upload_dependency() -> None:
    sched = base_schedule()
    fwd = sched.tasks[fwd_id(2, 0)]
    replace_task(sched, fwd.id, deps=tuple(d for d in fwd.deps if d.kind is not Kind.UPLOAD))
    rejects(sched, fwd.id)


# ---------------------------------------------------------------------------------- rendering & placement

@pytest.mark.parametrize("devices", [1, 2, 4])
def test_to_text_lists_every_lane_and_task(devices: int) -> None:
    sched = build_schedule(plan_for(devices, [1, 3, 2], 2, 3, 2, tied=False), BATCH, tied=False)
    text = to_text(sched)
    assert len(sched.lanes) == 3 * devices + 1  # compute, h2d, d2h per device + the optimizer
    for lane in sched.lanes:
        assert f"[{lane}]" in text
    for tid in sched.tasks:
        assert str(tid) in text
    assert text.splitlines()[0].startswith("schedule: batch=5")


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("devices", range(2, 9))
def test_round_robin_placement(devices: int, tied: bool) -> None:
    for packs in range(1, 13):
        fwd, bwd, embed, head = round_robin_devices(packs, devices, tied)
        assert len(fwd) == len(bwd) == packs
        assert all(0 <= d < devices for d in fwd + bwd + (embed, head))
        if tied:
            assert head == embed
        if packs >= 2:
            assert len(set(fwd + bwd)) > 1, "one device got every pack"
            assert len(set(fwd)) == min(packs, devices)  # forward deals packs out in turn
        # the rotation: consecutive stages land on consecutive devices
        seq = [embed] + list(fwd)
        assert all((b - a) % devices == 1 for a, b in zip(seq, seq[1:]))
        rev = list(reversed(bwd))
        assert all((b - a) % devices == 1 for a, b in zip(rev, rev[1:]))


def test_single_device_plan_places_everything_on_device_zero() -> None:
    plan = plan_for(1, 2, 1, 1, 1, tied=True)
    assert set(plan.fwd_device) == set(plan.bwd_device) == {0} and plan.embed_device == plan.head_device == 0


# ---------------------------------------------------------------------------------- plans

@pytest.mark.parametrize("stash", ["device", "host", ["device", "host", "host", "device"]])
def test_plan_json_round_trip(stash, tmp_path) -> None:
    plan = make_plan(BLOCKS, pack_size=[1, 3, 2], micro_batch_size=2, backward_micro_batch_size=3, num_devices=3,
                     prefetch_window=2, stash=stash, tied=False, grad_slots=4)
    text = plan.to_json()
    back = Plan.from_json(text)
    assert back == plan
    assert back.to_json() == text
    assert isinstance(back.packs, tuple) and all(isinstance(p, tuple) for p in back.packs)
    assert isinstance(back.stash_on_host, tuple) and isinstance(back.fwd_device, tuple)
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    # a loaded plan builds the very same schedule
    a, b = build_schedule(plan, BATCH, False), build_schedule(back, BATCH, False)
    assert to_text(a) == to_text(b)


def test_plan_json_defaults_round_trip() -> None:
    plan = Plan(packs=((0, 1), (2,)), micro_batch_size=1, backward_micro_batch_size=1)
    assert Plan.from_json(plan.to_json()) == plan


def test_split_packs() -> None:
    assert split_packs(6, 4) == ((0, 1, 2, 3), (4, 5))
    assert split_packs(6, [1, 3, 2]) == ((0,), (1, 2, 3), (4, 5))
    with pytest.raises(tinypipe.ConfigError, match="sum to 5"):
        split_packs(6, [2, 3])


def test_ids_and_lanes_reject_what_no_builder_makes() -> None:
    for bad in ("fwd/1", "fwd/a/0", "up/x1/L2", "ru/L", "head/0/1", "dl/5", ""):
        with pytest.raises(ValueError, match="not a task id"):
            TaskId.parse(bad)
    for bad in ("dev:compute", "devX:h2d", "host:", "gpu0:compute", "compute"):
        with pytest.raises(ValueError, match="not a lane name"):
            Lane.parse(bad)
    assert Lane.parse("dev12:d2h") == Lane(12, "d2h") and str(Lane(None, "optimizer")) == "host:optimizer"
    assert str(TaskId(Kind.UPLOAD, pack=3, layer=7, phase="b")) == "up/b3/L7"


# ---------------------------------------------------------------------------------- typed ids

#: every builder of schedule.ids and the text it must keep (traces, dumps and messages show it)
ID_TEXTS = [
    (resident_upload_id(0), "ru/E"), (resident_upload_id(HEAD), "ru/H"), (resident_upload_id(4), "ru/L4"),
    (upload_id("f", 3, 7), "up/f3/L7"), (upload_id("b", 0, 12), "up/b0/L12"), (EMBED_FWD_ID, "efwd"),
    (fwd_id(3, 1), "fwd/3/1"), (head_id(2), "head/2"), (bwd_id(10, 0), "bwd/10/0"), (EMBED_BWD_ID, "ebwd"),
    (reduce_id(5), "red/L5"), (download_id(0), "dl/L0"), (update_id(33), "upd/L33"),
]
LANE_TEXTS = [(Lane(0, "compute"), "dev0:compute"), (Lane(12, "h2d"), "dev12:h2d"),
              (Lane(3, "d2h"), "dev3:d2h"), (Lane(1, "collective"), "dev1:collective"),
              (OPTIMIZER_LANE, "host:optimizer"), (Lane(None, "deferred-optimizer"), "host:deferred-optimizer")]


def test_ids_and_lanes_keep_their_text_and_read_back() -> None:
    for tid, text in ID_TEXTS:
        assert str(tid) == text and f"{tid}" == text
        assert TaskId.parse(text) == tid and hash(TaskId.parse(text)) == hash(tid)
    assert len({tid for tid, _ in ID_TEXTS}) == len(ID_TEXTS)
    for lane, text in LANE_TEXTS:
        assert str(lane) == text and Lane.parse(text) == lane and hash(Lane.parse(text)) == hash(lane)


@pytest.mark.parametrize("devices, turn", [(1, 0), (3, 0), (1, 1)])
def test_schedule_is_keyed_by_typed_ids(devices: int, turn: int) -> None:
    """Tasks, deps, lanes and the order are TaskId / Lane, never their text: a str key would
    never equal the typed id the step looks up. Every key's text reads back to the key."""
    plan = make_plan(BLOCKS, pack_size=[1, 3, 2], micro_batch_size=1, backward_micro_batch_size=2,
                     num_devices=devices, prefetch_window=1, stash="device", tied=False, turn_packs=turn)
    sched = build_schedule(plan, BATCH, tied=False, reduce=True)
    validate(sched)
    assert all(type(k) is TaskId and type(t.id) is TaskId and k == t.id for k, t in sched.tasks.items())
    assert all(type(d) is TaskId for t in sched.tasks.values() for d in t.deps)
    assert all(type(k) is Lane for k in sched.lanes)
    assert all(type(i) is TaskId for ids in sched.lanes.values() for i in ids)
    assert all(type(i) is TaskId for i in sched.order)
    assert {t.kind for t in sched.tasks.values()} == set(Kind)  # every kind, reductions included
    for tid in sched.tasks:
        assert TaskId.parse(str(tid)) == tid
    for lane in sched.lanes:
        assert Lane.parse(str(lane)) == lane
    assert "fwd/0/0" not in sched.tasks and fwd_id(0, 0) in sched.tasks  # text finds nothing
    assert "dev0:compute" not in sched.lanes and Lane(0, "compute") in sched.lanes


def test_schedule_refuses_text_ids() -> None:
    sched = build_schedule(plan_for(1, 2, 2, 2, 1, tied=False), BATCH, tied=False)
    with pytest.raises(TypeError, match="TaskId"):
        sched.add(Task("fwd/9/0", Kind.FWD, 0))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="TaskId"):
        sched.add(Task(fwd_id(9, 0), Kind.FWD, 0, deps=("fwd/8/0",)))  # type: ignore[arg-type]
    assert fwd_id(9, 0) not in sched.tasks
