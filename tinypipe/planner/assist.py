"""Which layers' AdamW updates to assist on the GPU (``Plan.assisted``): under clipping, the
leftover ones (here); without, those stepped right after their backward
(:mod:`tinypipe.planner.backward_assist`).

After a clipped step the host AdamW pass of every host-stepped layer runs ahead of the next
forward, and each upload waits for its layer (:mod:`tinypipe.planner.clipped`). On the H200 box
that pass is the bound: at the clipped rate (~3.4 G params/s) a block's update takes ~4x its
4 B/param upload. An assisted layer skips the host: its upload carries master, moments and
gradient (:data:`ASSIST_UP_BYTES`, on the link about as long as the host takes for the update),
the device steps it, and master and moments come back on the d2h lane (:data:`ASSIST_DOWN_BYTES`),
which the forward leaves nearly idle. Assisting every layer would move the bound to the link; the
best split keeps host pass and link level (for a 3B model about one streamed block in three).

:func:`choose_assisted` walks the next step's upload order as the race does
(:func:`~tinypipe.planner.clipped.race_choosing`), assisting a layer whenever that lets the next
upload be done sooner. :func:`tinypipe.planner.cost.predict_step_time` (``assist=True``) keeps
the choice only if its clipped step, raced with it, is shorter; the search
(:mod:`tinypipe.planner.search`) keeps it only if the plan still fits with the scratch every device
then holds (:func:`tinypipe.memory.device_pool.assist_scratch_numel`, 192 MiB).

With the planner's choice a clipped step runs 0.85-0.93x its unclipped speed, faster than with
the host pass alone (docs/measured.md). Each round trip holds its upload stream
:data:`ASSIST_CHUNK_S` per chunk beyond its bytes' link time (fitted); and host pass and round
trips share host DRAM, whose floor (:mod:`tinypipe.planner.dram`) the cost model applies too.

Without clipping an assisted layer is stepped right after its backward (its state's round trip,
12 B/param each way, replaces the 4 B/param gradient download): the backward's host AdamW term
shrinks and its link terms grow. :func:`tinypipe.planner.cost.predict_step_time` chooses those
layers itself (``backward_assist.choose_backward_assist``: in backward order while the backward + tail gets
shorter) and keeps them only if they save enough of the step (``UNCLIPPED_ASSIST_MIN_GAIN``); on
the H200 preset they never do (16 cores keep up), on a host with a slow AdamW they can nearly halve
the step (docs/measured.md). ``nonfinite="skip"`` steps are not modelled as
deferred. Nothing is assisted for data-parallel replicas (their leftover work is the sharded
path's) or in plans with state on the SSD (their clipped step is timed by the SSD's lanes, not by
the race).
"""

from __future__ import annotations

from typing import Sequence

from tinypipe.memory.device_pool import ASSIST_CHUNK_NUMEL
from tinypipe.planner.clipped import RaceResult, RaceUpload, StashMoves, race_choosing
from tinypipe.schedule.plan import Plan

#: An assisted layer's first upload after a clipped step (runtime/optim/assist.py): fp32 master, both
#: AdamW moments and the retained gradient go up per trainable parameter; master and moments come
#: back down.
ASSIST_UP_BYTES = 16
ASSIST_DOWN_BYTES = 12
#: Seconds per chunk (:data:`~tinypipe.memory.device_pool.ASSIST_CHUNK_NUMEL` elements) an assisted
#: round trip holds its upload stream beyond the link time of its bytes: the lane thread's launches
#: between one chunk's upload and the next. Fitted by ``bench/archive/refit_assist.py`` on the assisted
#: blocks' first uploads in one traced run (docs/measured.md).
ASSIST_CHUNK_S = 6.1e-4


def assistable(plan: Plan) -> frozenset[int]:
    """Layers whose clipped update the runtime can assist in ``plan``: every layer but those stepped
    on their device (resident packs, ``device_optimizer``); none with replicas or an SSD tier."""
    if plan.replicas > 1 or plan.offload:
        return frozenset()
    stepped = set().union(*(plan.device_optimized(d) for d in range(plan.num_devices)))
    return frozenset(range(plan.num_blocks + 2)) - stepped


def assisted_upload(u: RaceUpload, numel: int, frozen_bytes: int, device_s_per_param: float) -> RaceUpload:
    """``u`` (a layer of ``numel`` elements, ``u.host_numel`` of them trainable) as an assisted first
    upload: no host time, master + moments + gradient up (frozen weights as before), master +
    moments down, the device's AdamW on the upload stream."""
    t = u.host_numel
    chunks = -(-t // ASSIST_CHUNK_NUMEL)
    return RaceUpload(u.device, u.pack, 0, t * ASSIST_UP_BYTES + (numel - t) * frozen_bytes, u.gates_forward,
                      u.layer, t * ASSIST_DOWN_BYTES, t * device_s_per_param + chunks * ASSIST_CHUNK_S)


def choose_assisted(uploads: Sequence[RaceUpload], alternatives: Sequence[RaceUpload | None],
                    pack_forward_s: Sequence[float], *, slots: int, devices: int, h2d: float,
                    adamw_rate: float, d2h: float, bidir: float, stash_reads: Sequence[StashMoves | None],
                    stash_writes: Sequence[StashMoves | None],
                    chunk_down_bytes: int) -> tuple[tuple[int, ...], RaceResult]:
    """The layers to assist among those with an alternative (module docstring) and the race run
    with them; the keywords are the race's (:func:`~tinypipe.planner.clipped.race_forward_end`)."""
    taken, race = race_choosing(uploads, alternatives, pack_forward_s, slots=slots, devices=devices,
                                h2d=h2d, adamw_rate=adamw_rate, d2h=d2h, bidir=bidir, stash_reads=stash_reads,
                                stash_writes=stash_writes, chunk_down_bytes=chunk_down_bytes)
    return tuple(sorted(u.layer for u, t in zip(uploads, taken) if t)), race
