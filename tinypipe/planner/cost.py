"""Predicted step time of a plan on a :class:`HardwareSpec`: a phase-wise roofline.

A step has three phases on the critical path, each as slow as its slowest resource, plus a fill
at the start and an exposed tail at the end::

    step = fill + forward + head + backward + tail

Here the phases are put together (:func:`predict_step_time`); the work they time is
:mod:`tinypipe.planner.work`'s (rates, the packs' bytes, each device's lanes, the host AdamW
lane's arrivals), the clipped step's race runs on :mod:`tinypipe.planner.clipped_step`'s inputs,
the unclipped step's assisted layers are :mod:`tinypipe.planner.backward_assist`'s and the SSD's
lanes :mod:`tinypipe.planner.ssd_lanes`'. Unqualified constants below are ``work``'s.

* **fill** -- before the first pack can compute: the resident embedding/head uploads and the
  first pack's layer uploads (fp32 master weights, 4 B/param, cast on the GPU).
* **forward** = max over devices of max(forward compute (at ``FORWARD_RATE_FACTOR`` x the
  backward's rate per FLOP) + per-pack overhead, forward uploads / h2d,
  stash writes / d2h, both / bidir). A host-stashed pack input is written down and read back
  up in the forward and read up again in the backward.
  On N devices the compute term is scaled by N / (1 + (N-1) * ``MULTI_DEVICE_SCALING``):
  the lanes do not scale linearly (pipeline bubbles, host-side contention).
* **head** -- fused norm + LM head + loss: 6 * N_head * T FLOPs at ``HEAD_EFFICIENCY`` of the
  block rate (token chunks of a few hundred rows run a little below the blocks' GEMMs).
* **backward** = max over devices of max(recompute + backward compute + overhead (a pack that
  keeps its activations, ``Plan.keep_activations``, has no recompute; its backward runs one forward
  micro-batch's graph at a time, at the forward micro-batch's rate),
  backward uploads / h2d, gradient downloads (4 B/param) / d2h, (uploads + downloads) / bidir);
  the turn's packs, like a kept last pack, upload nothing for their backward.
* **tail** -- what the host AdamW lane has left when the backward ends
  (:mod:`tinypipe.planner.host_lane`): a queue that steps each host-held layer once its pack's
  backward is done and its last gradient chunk is down (after a micro-batch-wise turn,
  ``Plan.turn_packs``, once the whole turn is through), at ``BACKWARD_ADAMW_EFFICIENCY`` of
  the AdamW rate measured alone. A lane that keeps up leaves the lowest host-stepped pack's and
  the embedding's updates; one that lags leaves its backlog too. Resident packs' backward runs
  after the last host pack's, and hides its update. With ``device_optimizer`` the embedding / head
  are stepped on their device instead (no upload, download or host AdamW for them).

* **clipped step** (``StepTime.clipped_step_s``): when global-norm clipping triggers, every
  host-stepped layer's AdamW runs after the backward, in the next step's upload order, racing the
  next forward layer by layer (:mod:`tinypipe.planner.clipped`); its backward has no host AdamW
  to hide and no tail. Layers stepped on their device (resident packs, ``device_optimizer``)
  take no host time, which is why the search, ranking by this time under clipping, keeps more on
  the GPU. Assisted layers (``Plan.assisted``, chosen by :mod:`tinypipe.planner.assist`) take no
  host time either: their first upload carries master, moments and gradient
  (``ASSIST_UP_BYTES``), the device steps them and master and moments come back down
  (``ASSIST_DOWN_BYTES``) beside the forward's stash writes. The race moves those bytes on
  the links (and the host-stashed pack inputs with them); the forward phase's roofline carries
  them too, so the clipped step is never shorter than what the two link directions can move.

* **assisted, unclipped** (``Plan.assisted`` without clipping): each assisted layer is stepped
  on its device right after its backward -- its master and moments go up (12 B/param) and come
  back instead of its gradient (12 instead of 4 B/param), and it leaves the host AdamW term; a
  pack-0 / embedding layer trades its tail AdamW for that round trip after the last backward.
  ``predict_step_time(assist=True, clipping=False)`` chooses them
  (:func:`~tinypipe.planner.backward_assist.choose_backward_assist`) where they save at least
  :data:`~tinypipe.planner.backward_assist.UNCLIPPED_ASSIST_MIN_GAIN` of the step.

* **deferred, unclipped** (``Plan.deferred``): those layers' host AdamW leaves the backward (and
  the tail) and runs before their uploads in the next forward, which the clipped race with only
  their updates times (:func:`~tinypipe.planner.clipped_step.deferred_forward_end`); the forward
  is no shorter than that.

* **SSD** (``plan.offload``, :mod:`tinypipe.planner.offload`): reads and writes are two more lanes
  at ``HardwareSpec.ssd_read_gbps`` / ``ssd_write_gbps``, beside the phase the runtime moves them
  in (:class:`~tinypipe.planner.ssd_lanes.SsdLanes`); ``StepTime.ssd_*`` holds the bytes and
  their seconds per step.

Compute counts matmul FLOPs: a block's forward 2 * N_block * T plus causal attention
2 * S * (heads * head_dim) * T; the recompute repeats the forward, the backward is twice it.
The achieved rate depends on the micro-batch: ``rate(T) = R * e(T) / e(8192)`` with
``e(T) = T / (T + T0)`` (``EFFICIENCY_T0``), R being the hardware's achieved rate at
8192-token micro-batches. Each pack execution (forward or backward, all its micro-batches)
costs ``PACK_OVERHEAD_S`` of synchronisation and launch latency.

With a measured profile (``tinypipe profile``; ``HardwareSpec.layer_profile`` at the plan's
precision) the forward, recompute, backward and head rates come from the measured per-layer times
interpolated over micro-batch tokens and sequence length (:mod:`tinypipe.planner.layer_profile`)
instead of the efficiency curve.

Calibrated on an H200 box (``h200-pcie5``) against measured steps (tests/test_planner.py holds the
comparison; the fits: docs/measured.md). Multi-GPU rests on one two-GPU run; beyond two devices it
is an extrapolation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from tinypipe.planner.assist import assistable, choose_assisted
from tinypipe.planner.backward_assist import (
    UNCLIPPED_ASSIST_MIN_GAIN,
    AssistSums,
    BackwardAssist,
    choose_backward_assist,
)
from tinypipe.planner.clipped import RaceResult
from tinypipe.planner.clipped_step import assist_bytes, clipped_adamw_rate, deferred_forward_end, race_of
from tinypipe.planner.dram import clipped_forward_dram
from tinypipe.planner.hardware import HardwareSpec
from tinypipe.planner.host_lane import ARRIVAL_TIME, BackwardOrder, lane_end_s
from tinypipe.planner.kept import kept_bytes
from tinypipe.planner.offload import ssd_traffic, with_stash_traffic
from tinypipe.planner.sizes import ModelSizes
from tinypipe.planner.ssd_lanes import SsdLanes
from tinypipe.planner.work import (
    DEVICE_ADAMW_S_PER_PARAM,
    DOWNLOAD_BYTES,
    UPLOAD_BYTES,
    Lanes,
    Rates,
    Work,
    add_host_gradient_traffic,
    add_host_kept_traffic,
    add_stash_traffic,
    backward_terms,
    fill_s,
    forward_terms,
    host_lane_arrivals,
    on_device,
    pack_work,
)
from tinypipe.schedule.plan import Plan, host_gradient_boundaries


@dataclass
class StepTime:
    """Predicted seconds per step and the terms behind it."""

    fill_s: float
    forward_s: float
    head_s: float
    backward_s: float
    tail_s: float
    step_s: float
    tokens_per_s: float
    # compute-lane work (matmuls at the achieved rate, pack overheads, exposed uploads), all devices
    compute_s: float
    upload_s: float  # busiest device's link, both passes
    download_s: float
    optimizer_s: float  # all parameters through the CPU optimizer
    # when global-norm clipping triggers (every host AdamW step waits for the norm); None: not asked
    # for (``predict_step_time(clipping=False)``: the race costs the search as much as the rest)
    clipped_step_s: float | None
    forward_limit: str
    backward_limit: str
    # the SSD tier (plan.offload): bytes per step and their seconds at the hardware's SSD rates
    ssd_read_bytes: int = 0
    ssd_write_bytes: int = 0
    ssd_read_s: float = 0.0
    ssd_write_s: float = 0.0
    # layers whose clipped update ``clipped_step_s`` has the device do (the plan's, or those
    # ``predict_step_time(assist=True)`` chose)
    assisted: tuple[int, ...] = ()

    def as_dict(self) -> dict:
        d = asdict(self)
        if not (self.ssd_read_bytes or self.ssd_write_bytes):  # no SSD tier: the fields it had before
            for k in ("ssd_read_bytes", "ssd_write_bytes", "ssd_read_s", "ssd_write_s"):
                del d[k]
        if not self.assisted:
            del d["assisted"]
        return d

    def lanes(self) -> dict[str, float]:
        """Each resource's busy seconds per step (the SSD's only when the plan offloads)."""
        out = {"compute": self.compute_s, "upload": self.upload_s, "download": self.download_s,
               "cpu optimizer": self.optimizer_s}
        if self.ssd_read_bytes or self.ssd_write_bytes:  # one disk serves both (see SSD_SHARED_NOTE)
            out["ssd"] = self.ssd_read_s + self.ssd_write_s
        return out

    @property
    def bound_s(self) -> float:
        """max(compute, upload, download, optimizer, SSD read + write): the step if everything
        overlapped."""
        return max(self.lanes().values())

    @property
    def limit(self) -> str:
        """The busiest resource (what bounds the step)."""
        lanes = self.lanes()
        return max(lanes, key=lanes.get)


def predict_step_time(sizes: ModelSizes, plan: Plan, hw: HardwareSpec, *, batch: int, seq: int,
                      precision: str = "bf16", clipping: bool = True, assist: bool = False,
                      mlp_chunk: int = 0) -> StepTime:
    """Seconds per optimizer step of ``plan`` for ``batch`` sequences of ``seq`` tokens (``clipping``:
    also of a step where global-norm clipping triggers, ``StepTime.clipped_step_s``, with
    ``plan.assisted``; without ``clipping`` the assisted layers are stepped after their backward).
    ``assist``: choose the layers to assist instead (``plan.assisted`` is ignored) -- under
    ``clipping`` those whose clipped step raced with them is shorter
    (:func:`tinypipe.planner.assist.choose_assisted`), without it those that shorten the backward
    and tail (:func:`choose_backward_assist`): ``StepTime.assisted``. ``mlp_chunk`` (tokens per
    MLP chunk, 0: unchunked): a backward micro-batch of more tokens recomputes its chunks' matmuls
    once more, and host-stashed boundaries' gradients travel through host memory."""
    if assist and plan.assisted:
        plan = dataclasses.replace(plan, assisted=())
    P, R = plan.num_packs, plan.resident_packs
    tokens = batch * seq
    w = Work.of(sizes, plan, hw, batch=batch, seq=seq, precision=precision, mlp_chunk=mlp_chunk)
    rates, fwd_flops, packs, dequant = w.rates, w.fwd_flops, w.packs, w.dequant
    trains = sizes.layer_train_numels
    lora = bool(sizes.frozen_total)

    lanes = pack_work(packs, fwd_flops, rates, lora, dequant, w.chunk_flops, w.attn_flops, w.overheads)
    add_stash_traffic(lanes, plan, stash_bytes=w.stash_bytes, long_sequences=w.long_sequences)
    add_host_gradient_traffic(lanes, plan, w.stash_bytes, mlp_chunk > 0)
    if plan.kept_on_host:
        held = [kept_bytes(sizes, plan, q, batch=batch, seq=seq, precision=precision)
                if plan.on_host(q) else 0 for q in range(P)]
        add_host_kept_traffic(lanes, plan, held)
    dev = on_device(packs)
    lanes.down[plan.embed_device] += 0 if dev.embed else trains[0] * DOWNLOAD_BYTES
    lanes.down[plan.head_device] += 0 if dev.head else trains[-1] * DOWNLOAD_BYTES
    fill = fill_s(packs, dev.embed, dev.head, rates.h2d)

    slowdown = w.slowdown
    f_terms = forward_terms(lanes, slowdown, rates)
    forward = max(f_terms.values())
    head = (4.0 if lora else 6.0) * sizes.head_matmul_params * tokens / rates.head

    last_chunk = sizes.grad_slot_numel * DOWNLOAD_BYTES / rates.d2h
    b_terms = backward_terms(lanes, slowdown, rates)
    no_opt = max(b_terms.values())
    traffic = ssd_traffic(sizes, plan, precision)
    if plan.stash_on_ssd:  # pack inputs on the SSD: written, read back in the forward, read in the backward
        traffic = with_stash_traffic(traffic, plan, w.stash_bytes,
                                     host_gradient_boundaries(plan, mlp_chunk > 0))
    ssd = SsdLanes(traffic, hw)
    if ssd.on:  # state on the SSD: read/write lanes beside every phase (see SsdLanes)
        fill += ssd.t.fill_read / ssd.read
        # one disk: its reads and the previous step's tail writes, still landing, share it
        f_terms["ssd"] = ssd.both(ssd.t.forward_read, ssd.t.carry_write + ssd.t.forward_write)
        forward = max(f_terms.values())
    # deferred layers (Plan.deferred) are stepped in the next forward instead: off the backward's
    # host lane, racing that forward below
    deferred = frozenset(plan.deferred)
    bwd: BackwardAssist | None = None
    order = BackwardOrder.of(lanes.b_pack, plan.turn())  # the assist search re-prices the backward
    prefixes: dict[tuple[int, ...], AssistSums] = {}  # its sums so far (BackwardAssist.apply)

    def backward_and_tail(layers: tuple[int, ...]) -> tuple[dict[str, float], float, float, Lanes]:
        """With ``layers`` assisted right after their backward: the backward's terms, its seconds,
        the tail after it (the host lane's leftover, the tail layers' round trips, the SSD's tail
        writes) and the lanes with the round trips' bytes."""
        a_lanes, tail_link, launch_s = (lanes, 0.0, 0.0)
        if bwd is not None and layers:
            a_lanes, tail_link, launch_s = bwd.apply(lanes, layers, rates, prefixes)
        terms = backward_terms(a_lanes, slowdown, rates)
        if ssd.on:
            terms["ssd"] = ssd.both(ssd.t.backward_read, ssd.t.backward_write)
        b = max(terms.values()) + launch_s
        work = host_lane_arrivals(packs, order, dev, b, deferred | frozenset(layers), last_chunk)
        work.sort(key=ARRIVAL_TIME)  # stable, as lane_end_s's own: both calls below then sort in one pass
        # the lane as the backward's limit: when it is done with what arrived during the backward
        terms["cpu optimizer"] = lane_end_s([a for a in work if a.at_s < b], rates.backward_adamw)
        tail = max(lane_end_s(work, rates.backward_adamw) - b, tail_link,
                   ssd.t.tail_write / ssd.write + last_chunk if ssd.on else 0.0)
        return terms, b, tail, a_lanes

    b_terms, backward, tail, _ = backward_and_tail(())
    unclipped_assist: tuple[int, ...] = ()
    if not clipping and (plan.assisted or assist) and R < P:  # assisted right after their backward
        bwd = BackwardAssist.of(packs, dev)

        def cost(layers: tuple[int, ...]) -> float:
            _, b, t, _ = backward_and_tail(layers)
            return b + t

        layers = plan.assisted
        if assist:
            base = backward + tail
            least_gain = UNCLIPPED_ASSIST_MIN_GAIN * (fill + forward + head + base)
            # assisting only adds link bytes and launches: no choice ends the backward before its
            # terms without the host lane, so when even that saves too little, skip the search
            # (the same answer; on llama-2-70b's search a fifth of the plans stop here)
            lane_free = max(v for k, v in b_terms.items() if k != "cpu optimizer")
            layers = ()
            if base - lane_free >= least_gain:
                layers = choose_backward_assist(bwd, assistable(plan), base, cost)
                if base - cost(layers) < least_gain:
                    layers = ()  # not worth the scratch, the traffic and the chunk latency left out
        if layers:  # the step's traffic includes their trips
            b_terms, backward, tail, lanes = backward_and_tail(layers)
            unclipped_assist = tuple(sorted(layers))
    tail += dev.train * DEVICE_ADAMW_S_PER_PARAM
    if plan.deferred:  # the deferred updates run ahead of the next forward's uploads of their layers
        forward = max(forward, deferred_forward_end(w, dev, plan.deferred) - fill)
    step = fill + forward + head + backward + tail
    shared = _shared_gpu_floor(lanes, head, plan, hw, rates)
    step = max(step, shared)
    # clipping triggers: the host AdamW of every host-stepped layer waits for the global norm and
    # runs in the background ahead of the next forward, which follows it layer by layer
    clip_rate = clipped_adamw_rate(rates)
    clipped: float | None = None
    assisted = plan.assisted

    def roofline(layers: tuple[int, ...]) -> tuple[float, dict[str, float]]:
        """The fill and the forward's terms of a clipped step with ``layers`` assisted: their bytes
        on the links."""
        a_lanes, fill_extra = assist_bytes(packs, lanes, layers)
        terms = dict(f_terms, **(forward_terms(a_lanes, slowdown, rates) if layers else {}))
        return fill + fill_extra / rates.h2d, terms

    def dram_floor(layers: tuple[int, ...]) -> float:
        """The forward after a clipped step moves the host-held layers' state through host memory
        (:mod:`tinypipe.planner.dram`): no shorter than its bytes at the host's DRAM rate."""
        if not hw.host_dram_gbs:
            return 0.0
        win = clipped_forward_dram(sizes, plan, stash_bytes=w.stash_bytes, upload_bytes=UPLOAD_BYTES,
                                   frozen_bytes=packs.frozen_bytes, assisted=layers,
                                   long_sequences=w.long_sequences)
        return win.seconds(hw.host_dram_gbs)

    def raced(layers: tuple[int, ...], race: RaceResult) -> float:
        a_fill, terms = roofline(layers)
        # the head runs once the forward is done and its own update and upload are, and the
        # assisted layers' state is back down
        ends = (race.forward_end_s, race.uploads_end_s, race.downloads_end_s, dram_floor(layers))
        return (max(a_fill + max(terms.values()), *ends) + head + no_opt + last_chunk
                + dev.train * DEVICE_ADAMW_S_PER_PARAM)

    if clipping and ssd.on:  # the SSD's lanes beside the pass (see SsdLanes.clipped)
        a_fill, a_terms = roofline(assisted)
        host_pass = (sizes.train_total - dev.train - sum(trains[layer] for layer in assisted)) / clip_rate
        no_opt, host_pass = ssd.clipped(no_opt, host_pass, a_terms)
        clipped = a_fill + max(max(a_terms.values()), host_pass) + head + no_opt + last_chunk
    elif clipping:
        setup = race_of(w, dev)
        race = setup.run()
        clipped = raced(assisted, race)
        if assist and max(race.forward_end_s, race.uploads_end_s) > fill + forward:  # the host holds it up
            allowed = assistable(plan)
            alts = tuple(a if a is not None and a.layer in allowed else None for a in setup.alternatives)
            layers, walked = choose_assisted(setup.uploads, alts, setup.pack_forward_s, **setup.kwargs)
            faster = raced(layers, walked)
            if layers and faster < clipped - 1e-6:  # a gain, not a rounding of the same bound
                clipped, assisted = faster, layers
    if clipped is not None:
        clipped = max(clipped, shared)
    return StepTime(
        fill_s=fill, forward_s=forward, head_s=head, backward_s=backward, tail_s=tail, step_s=step,
        tokens_per_s=tokens / step, compute_s=sum(lanes.f_comp) + sum(lanes.b_comp) + head,
        upload_s=max(fu + bu for fu, bu in zip(lanes.f_up, lanes.b_up)) / rates.h2d,
        download_s=max(lanes.down) / rates.d2h,
        optimizer_s=(sizes.train_total - dev.train - sum(trains[x] for x in unclipped_assist)) / rates.adamw,
        clipped_step_s=clipped, forward_limit=max(f_terms, key=f_terms.get),
        backward_limit=max(b_terms, key=b_terms.get), ssd_read_bytes=ssd.t.read_bytes,
        ssd_write_bytes=ssd.t.write_bytes, ssd_read_s=ssd.t.read_bytes / ssd.read if ssd.on else 0.0,
        ssd_write_s=ssd.t.write_bytes / ssd.write if ssd.on else 0.0,
        assisted=assisted if clipping else unclipped_assist,
    )


def _shared_gpu_floor(lanes: Lanes, head: float, plan: Plan, hw: HardwareSpec, rates: Rates) -> float:
    """Stages that share one GPU (``hw.stages_per_gpu`` > 1) overlap as separate devices would,
    but their kernels and copies run on one GPU and one link: the step is no shorter than each
    GPU's share of all stages' compute, or of their uploads (round-robin packs spread the work
    evenly). 0 when every stage has a GPU of its own."""
    k = hw.stages_per_gpu
    if k <= 1:
        return 0.0
    gpus = max(1, plan.num_devices // k)
    compute = (sum(lanes.f_comp) + sum(lanes.b_comp) + head) / gpus
    uploads = (sum(lanes.f_up) + sum(lanes.b_up)) / gpus / rates.h2d
    return max(compute, uploads)
