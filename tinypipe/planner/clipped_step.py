"""What the clipped step's race runs on (:mod:`tinypipe.planner.clipped` runs it).

When global-norm clipping triggers, every host-stepped layer's AdamW runs after the backward, in
the next step's upload order, racing the next forward layer by layer. Here: that upload order
(plain and with its layers assisted), the host-stashed inputs' moves, each pack's forward seconds,
the host pass's rate, and the assisted layers' extra bytes on the forward's links; also the
forward of an unclipped step whose deferred updates (``Plan.deferred``) run ahead of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from tinypipe.memory.device_pool import ASSIST_CHUNK_NUMEL
from tinypipe.planner.assist import ASSIST_DOWN_BYTES, ASSIST_UP_BYTES, assisted_upload
from tinypipe.planner.clipped import RaceResult, RaceUpload, StashMove, StashMoves, race_forward_end
from tinypipe.planner.hardware import HardwareSpec
from tinypipe.planner.sizes import ModelSizes
from tinypipe.planner.work import (
    DEVICE_ADAMW_S_PER_PARAM,
    PACK_OVERHEAD_S,
    UPLOAD_BYTES,
    Lanes,
    OnDevice,
    Packs,
    Rates,
    Work,
    layer_devices,
    on_device,
)
from tinypipe.schedule.plan import Plan, host_stashed_inputs


#: Host AdamW rate of a clipped step's leftover pass (every host-stepped layer waits for the global
#: norm, then runs in the background ahead of the next forward, :mod:`tinypipe.planner.clipped`)
#: relative to the profiled rate: the pass moves the retained gradient too and shares DRAM with the
#: uploads and the cores with the lanes. Fitted together with FORWARD_RATE_FACTOR (the pass races
#: the forward) on the median of several clipped runs by ``bench/archive/refit_clipped.py``, and
#: checked out of sample on a larger model's (docs/measured.md).
CLIPPED_ADAMW_EFFICIENCY = 0.918


def clipped_adamw_rate(rates: Rates) -> float:
    """Parameters/s of the host pass after a clipped step (:data:`CLIPPED_ADAMW_EFFICIENCY` of the
    host AdamW's rate)."""
    return rates.adamw * CLIPPED_ADAMW_EFFICIENCY


@lru_cache(maxsize=1024)
def race_order(sizes: ModelSizes, pack_list: tuple[tuple[int, ...], ...], fwd_device: tuple[int, ...],
                embed_device: int, head_device: int, resident: int, embed_on_device: bool,
                head_on_device: bool, frozen_bytes: int) -> tuple[RaceUpload, ...]:
    """The next step's upload order as the clipped race sees it (:mod:`tinypipe.planner.clipped`):
    the embedding, the resident packs (stepped on their device: nothing), the first streamed pack,
    the head (behind the first pack's uploads, as the builder orders it), the other packs. Cached
    by what it depends on: the search's plans share a few packings."""
    trains = sizes.layer_train_numels
    head_id = len(trains) - 1

    def up(n: int, t: int) -> int:
        return t * UPLOAD_BYTES + (n - t) * frozen_bytes

    head: tuple[RaceUpload, ...] = ()
    if not head_on_device:
        head = (RaceUpload(head_device, None, trains[-1], up(sizes.head_numel, trains[-1]), layer=head_id),)
    out: list[RaceUpload] = []
    if not embed_on_device:
        out.append(RaceUpload(embed_device, None, trains[0], up(sizes.embed_numel, trains[0]),
                              gates_forward=True, layer=0))
    for q in range(resident, len(pack_list)):
        for b in pack_list[q]:
            out.append(RaceUpload(fwd_device[q], q, trains[1 + b], up(sizes.block_numels[b], trains[1 + b]),
                                  layer=1 + b))
        if q == resident:
            out.extend(head)
    if resident == len(pack_list):  # no streamed pack: the head alone
        out.extend(head)
    return tuple(out)


@lru_cache(maxsize=1024)
def assisted_order(sizes: ModelSizes, pack_list: tuple[tuple[int, ...], ...], fwd_device: tuple[int, ...],
                    embed_device: int, head_device: int, resident: int, embed_on_device: bool,
                    head_on_device: bool, frozen_bytes: int) -> tuple[RaceUpload | None, ...]:
    """Per upload of :func:`race_order` (the same arguments) its assisted form (None: nothing
    trains in it); cached like the order itself."""
    numels = sizes.layer_numels
    order = race_order(sizes, pack_list, fwd_device, embed_device, head_device, resident, embed_on_device,
                        head_on_device, frozen_bytes)
    return tuple(assisted_upload(u, numels[u.layer], frozen_bytes, DEVICE_ADAMW_S_PER_PARAM) if u.host_numel
                 else None for u in order)


@dataclass(frozen=True)
class ClippedRace:
    """What the clipped race of a plan runs on (:func:`tinypipe.planner.clipped.race_forward_end`):
    the upload order with the plan's assisted layers as assisted uploads, each upload's assisted
    form (None: nothing to assist), each pack's forward seconds, and the rest of the race's
    keywords (slots, devices, link rates, host-pass rate, stash moves)."""

    uploads: tuple[RaceUpload, ...]
    alternatives: tuple[RaceUpload | None, ...]
    pack_forward_s: tuple[float, ...]
    kwargs: dict

    def run(self) -> RaceResult:
        return race_forward_end(self.uploads, self.pack_forward_s, **self.kwargs)


def race_of(w: Work, dev: OnDevice) -> ClippedRace:
    """The race of ``w``'s plan: its uploads in order, the assisted ones as such."""
    packs, rates = w.packs, w.rates
    plan = packs.plan
    key = (plan.packs, plan.fwd_device, plan.embed_device, plan.head_device, plan.resident_packs, dev.embed,
           dev.head, packs.frozen_bytes)
    plain = race_order(packs.sizes, *key)
    alternatives = assisted_order(packs.sizes, *key)
    uploads = plain
    if plan.assisted:
        assisted = set(plan.assisted)
        uploads = tuple(a if u.layer in assisted and a is not None else u
                        for u, a in zip(plain, alternatives))
    P, n = plan.num_packs, plan.num_devices
    reads: list[StashMove | None] = [None] * P
    writes: list[StashMoves | None] = [None] * P
    stashed = host_stashed_inputs(plan, w.long_sequences)
    for q in range(1, P):  # pack q's host-stashed input: written by pack q - 1's forward, read by q's
        if stashed[q]:
            writes[q - 1] = (plan.fwd_device[q - 1], w.stash_bytes)
            reads[q] = (plan.fwd_device[q], w.stash_bytes)
    if P and stashed[0]:  # the embedding's output (long sequences): written down as pack 0 starts,
        reads[0] = (plan.fwd_device[0], w.stash_bytes)  # read up by its forward
        embed: StashMove = (plan.embed_device, w.stash_bytes)
        writes[0] = embed if writes[0] is None else (embed, writes[0])
    # each pack's forward compute, the N devices' share of it as in the forward phase
    pack_fwd = tuple((w.fwd_flops[q] / rates.forward + PACK_OVERHEAD_S + w.dequant[q][0]
                      + (w.overheads[q][0] if w.overheads else 0.0)) * w.slowdown / n for q in range(P))
    kwargs = dict(slots=plan.param_slots(), devices=n, h2d=rates.h2d, d2h=rates.d2h, bidir=rates.bidir,
                  adamw_rate=clipped_adamw_rate(rates), stash_reads=tuple(reads),
                  stash_writes=tuple(writes), chunk_down_bytes=ASSIST_CHUNK_NUMEL * ASSIST_DOWN_BYTES)
    return ClippedRace(uploads, alternatives, pack_fwd, kwargs)


def deferred_forward_end(w: Work, dev: OnDevice, deferred: tuple[int, ...]) -> float:
    """When an unclipped step's forward ends with ``deferred`` layers' host AdamW left over from
    the step before (``Plan.deferred``): the clipped race with only their updates to run ahead of
    their uploads (the others were stepped in the backward)."""
    race = race_of(w, dev)
    keep = set(deferred)
    uploads = tuple(u if u.layer in keep else dataclasses.replace(u, host_numel=0) for u in race.uploads)
    return race_forward_end(uploads, race.pack_forward_s, **race.kwargs).forward_end_s


def clipped_race(sizes: ModelSizes, plan: Plan, hw: HardwareSpec, *, batch: int, seq: int,
                 precision: str = "bf16", mlp_chunk: int = 0) -> ClippedRace:
    """The inputs of ``plan``'s clipped race (what :func:`predict_step_time` runs for
    ``StepTime.clipped_step_s``), for choosers that walk it and tests (``mlp_chunk``: as there)."""
    w = Work.of(sizes, plan, hw, batch=batch, seq=seq, precision=precision, mlp_chunk=mlp_chunk)
    return race_of(w, on_device(w.packs))


def assist_bytes(packs: Packs, lanes: Lanes, assisted: tuple[int, ...]) -> tuple[Lanes, int]:
    """The forward's link bytes with the extra upload and the download of the ``assisted`` layers:
    (per-device lanes, the extra bytes of the layers the fill uploads)."""
    plan, trains = packs.plan, packs.sizes.layer_train_numels
    if not assisted:
        return lanes, 0
    f_up, f_down = list(lanes.f_up), list(lanes.f_down)
    extra_up = ASSIST_UP_BYTES - UPLOAD_BYTES
    head_id = plan.num_blocks + 1
    where = layer_devices(plan, plan.fwd_device)
    first = {0} | ({head_id} if plan.head_device == plan.embed_device else set()) | (
        set() if plan.resident_packs else {b + 1 for b in plan.packs[0]})
    fill = 0
    for layer in assisted:
        d, t = where[layer], trains[layer]
        f_down[d] += t * ASSIST_DOWN_BYTES
        if layer in first:  # uploaded before the first pack computes
            fill += t * extra_up
        else:
            f_up[d] += t * extra_up
    return dataclasses.replace(lanes, f_up=f_up, f_down=f_down), fill
