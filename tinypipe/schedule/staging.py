"""What one step reads from the SSD, in which order, for which task: the staging order, as data.

A layer's offloaded state (see ``Plan.offload``) is read into staging slots ahead of the task that
needs it first, and given back after the task that needs it last:

- **upload sets** -- the master weights (forward and resident uploads) and frozen weights (every
  upload) of one upload task, released once the copy to the device is done;
- **master sets** -- the master weights of a layer whose backward upload reads them: kept from
  that upload until the layer's optimizer step, which updates them in the slot and writes them
  back. So a master is read twice per step (forward, backward) and written once. Keeping the
  forward's copy until the backward instead would hold every layer's master at the head (the
  whole model); the backward copy is held for about a pack plus the prefetch window;
- **state sets** -- the moments, the retained gradient (a slot the download fills) and the master
  of a layer without a backward upload (embedding, head, the last pack whose slots carry over):
  first needed by the layer's gradient download (gradient on the SSD) or its update.

Each pool's sets are issued in the order their first users appear in the schedule's global order
(consistent with every dependency), each set taking all its slots at once. Why that cannot
deadlock: the earliest unfinished task's set is issued behind sets whose first users finished;
those sets come back once their last users finish, and the only sets whose last user can come
later are the master sets of the same pack (its backward uploads all precede its updates) -- so a
pool that holds one pack's master sets plus one state set always makes progress
(:func:`pool_slots`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

from tinypipe.schedule.builder import build_schedule
from tinypipe.schedule.ids import Kind, TaskId
from tinypipe.schedule.plan import Plan
from tinypipe.schedule.tasks import Schedule

PAGE = 4096  # staging slots are whole pages (tinypipe.storage.StagingPool)

#: How many layers' optimizer state are read ahead of the one being stepped. One read in flight
#: while the optimizer steps the previous layer keeps both the disk and the CPU busy; a second
#: absorbs the difference between layers (the embedding and head against a block) and the jitter
#: of a shared disk. More buys nothing when the SSD is the bottleneck (it reads no faster for
#: being asked earlier) and costs a layer of DRAM per set.
DEFAULT_READ_AHEAD = 2

Role = Literal["upload", "master", "state"]
UPDATE_NAMES = ("master", "exp_avg", "exp_avg_sq", "grad")


@dataclass(frozen=True)
class StageSet:
    """Slots for ``names`` of ``layer``, first needed by task ``first``."""

    role: Role
    layer: int
    names: tuple[str, ...]
    first: TaskId


@dataclass(frozen=True)
class StagingOrder:
    """One schedule's sets: ``uploads`` for the upload pool, ``updates`` (master and state sets)
    for the update pool, each in issue order, and where each task finds its set."""

    uploads: tuple[StageSet, ...] = ()
    updates: tuple[StageSet, ...] = ()
    upload_of: dict[TaskId, int] = field(default_factory=dict)  # upload task id -> index in uploads
    master_of: dict[int, int] = field(default_factory=dict)  # layer -> index of its master set
    state_of: dict[int, int] = field(default_factory=dict)  # layer -> index of its state set

    @property
    def empty(self) -> bool:
        return not self.uploads and not self.updates


def staging_order(schedule: Schedule, regions: Mapping[int, Collection[str]]) -> StagingOrder:
    """The staging order of ``schedule`` for the SSD ``regions`` (layer -> names of its offloaded
    LayerState fields and ``"grad"``)."""
    uploads: list[StageSet] = []
    updates: list[StageSet] = []
    upload_of: dict[TaskId, int] = {}
    master_of: dict[int, int] = {}
    state_of: dict[int, int] = {}
    for tid in schedule.order:
        task = schedule.tasks[tid]
        if not task.layers:
            continue
        layer = task.layers[0]
        names = regions.get(layer, ())
        if not names:
            continue
        if task.kind in (Kind.UPLOAD, Kind.RESIDENT_UPLOAD):
            backward = task.kind is Kind.UPLOAD and tid.phase == "b"
            own = tuple(n for n in ("master", "frozen") if n in names and not (backward and n == "master"))
            if backward and "master" in names and layer not in master_of:
                master_of[layer] = len(updates)
                updates.append(StageSet("master", layer, ("master",), tid))
            if own:
                upload_of[tid] = len(uploads)
                uploads.append(StageSet("upload", layer, own, tid))
        elif task.kind in (Kind.DOWNLOAD, Kind.UPDATE) and layer not in state_of:
            if task.kind is Kind.DOWNLOAD and "grad" not in names:
                continue  # the download writes a DRAM buffer: the update is the first user
            shared = layer in master_of
            state = tuple(n for n in UPDATE_NAMES if n in names and not (shared and n == "master"))
            if state:
                state_of[layer] = len(updates)
                updates.append(StageSet("state", layer, state, tid))
    return StagingOrder(tuple(uploads), tuple(updates), upload_of, master_of, state_of)


def pool_slots(order: StagingOrder, max_pack: int, prefetch_window: int, num_devices: int,
               read_ahead: int = DEFAULT_READ_AHEAD) -> tuple[int, int]:
    """(upload pool slots, update pool slots) for ``order``; 0 where a pool has no sets.

    Upload pool: a set per layer the uploads prefetch (``prefetch_window`` per device) plus the
    one being copied. Update pool: ``read_ahead`` state sets plus the one whose write-back is
    landing, and -- when backward uploads read masters -- a pack's master sets plus the prefetch
    window's (at least one pack's are needed to progress, see the module docstring)."""
    up = max((len(s.names) for s in order.uploads), default=0)
    upload_slots = up * (max(1, prefetch_window) * num_devices + 1)
    state = max((len(s.names) for s in order.updates if s.role == "state"), default=0)
    masters = any(s.role == "master" for s in order.updates)
    update_slots = state * (read_ahead + 1) + (max_pack + max(1, prefetch_window) if masters else 0)
    return upload_slots, update_slots


@dataclass(frozen=True)
class PoolShape:
    """The two staging pools of a plan: slots and bytes per slot (whole pages) each."""

    upload_slots: int = 0
    upload_slot_bytes: int = 0
    update_slots: int = 0
    update_slot_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """Host memory the pools take (what the planner adds to the host need)."""
        return self.upload_slots * self.upload_slot_bytes + self.update_slots * self.update_slot_bytes


def staging_pools(plan: Plan, tied: bool, region_bytes: Mapping[tuple[int, str], int],
                  read_ahead: int = DEFAULT_READ_AHEAD) -> PoolShape:
    """The staging pools the runtime allocates for ``plan`` whose SSD regions are ``region_bytes``
    ((layer, name) -> bytes, as :func:`tinypipe.memory.host_store.offload_regions` lays them out).

    The update pool also serves a clipped step's leftover work, which stages a layer's master,
    moments and gradient at once: it holds at least one such set."""
    regions: dict[int, list[str]] = {}
    for layer, name in region_bytes:
        regions.setdefault(layer, []).append(name)
    if not regions:
        return PoolShape()
    order = staging_order(build_schedule(plan, 1, tied), regions)
    up, upd = pool_slots(order, max(len(p) for p in plan.packs), plan.prefetch_window, plan.num_devices,
                         read_ahead)
    leftover = [[n for n in UPDATE_NAMES if n in names] for names in regions.values()]
    if upd or any(leftover):
        upd = max(upd, max(len(x) for x in leftover))

    def slot(keys: list[tuple[int, str]]) -> int:
        return -(-max((region_bytes[k] for k in keys), default=0) // PAGE) * PAGE

    up_keys = [(s.layer, n) for s in order.uploads for n in s.names]
    upd_keys = [(s.layer, n) for s in order.updates for n in s.names]
    upd_keys += [(layer, n) for layer, names in regions.items() for n in names if n in UPDATE_NAMES]
    return PoolShape(up, slot(up_keys) if up else 0, upd, slot(upd_keys) if upd else 0)
