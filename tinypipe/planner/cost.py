"""Predicted step time of a plan on a :class:`HardwareSpec`: a phase-wise roofline.

A step has three phases on the critical path, each as slow as its slowest resource, plus a fill
at the start and an exposed tail at the end::

    step = fill + forward + head + backward + tail

* **fill** -- before the first pack can compute: the resident embedding/head uploads and the
  first pack's layer uploads (fp32 master weights, 4 B/param, cast on the GPU).
* **forward** = max over devices of max(forward compute (at :data:`FORWARD_RATE_FACTOR` x the
  backward's rate per FLOP) + per-pack overhead, forward uploads / h2d,
  stash writes / d2h, both / bidir). A host-stashed pack input is written down and read back
  up in the forward and read up again in the backward.
  On N devices the compute term is scaled by N / (1 + (N-1) * :data:`MULTI_DEVICE_SCALING`):
  the lanes do not scale linearly (pipeline bubbles, host-side contention).
* **head** -- fused norm + LM head + loss: 6 * N_head * T FLOPs at :data:`HEAD_EFFICIENCY` of the
  block rate (token chunks of a few hundred rows run a little below the blocks' GEMMs).
* **backward** = max over devices of max(recompute + backward compute + overhead (a pack that
  keeps its activations, ``Plan.keep_activations``, has no recompute; its backward runs one forward
  micro-batch's graph at a time, at the forward micro-batch's rate),
  backward uploads / h2d, gradient downloads (4 B/param) / d2h, (uploads + downloads) / bidir);
  the turn's packs, like a kept last pack, upload nothing for their backward.
* **tail** -- what the host AdamW lane has left when the backward ends
  (:mod:`tinypipe.planner.host_lane`): a queue that steps each host-held layer once its pack's
  backward is done and its last gradient chunk is down (after a micro-batch-wise turn,
  ``Plan.turn_packs``, once the whole turn is through), at :data:`BACKWARD_ADAMW_EFFICIENCY` of
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
  ``predict_step_time(assist=True, clipping=False)`` chooses them (:func:`_choose_backward_assist`)
  where they save at least :data:`UNCLIPPED_ASSIST_MIN_GAIN` of the step.

* **deferred, unclipped** (``Plan.deferred``): those layers' host AdamW leaves the backward (and
  the tail) and runs before their uploads in the next forward, which the clipped race with only
  their updates times (:func:`_deferred_forward_end`); the forward is no shorter than that.

* **SSD** (``plan.offload``, :mod:`tinypipe.planner.offload`): reads and writes are two more lanes
  at ``HardwareSpec.ssd_read_gbps`` / ``ssd_write_gbps``, beside the phase the runtime moves them
  in (:class:`_SsdLanes`); ``StepTime.ssd_*`` holds the bytes and their seconds per step.

Compute counts matmul FLOPs: a block's forward 2 * N_block * T plus causal attention
2 * S * (heads * head_dim) * T; the recompute repeats the forward, the backward is twice it.
The achieved rate depends on the micro-batch: ``rate(T) = R * e(T) / e(8192)`` with
``e(T) = T / (T + T0)`` (:data:`EFFICIENCY_T0`), R being the hardware's achieved rate at
8192-token micro-batches. Each pack execution (forward or backward, all its micro-batches)
costs :data:`PACK_OVERHEAD_S` of synchronisation and launch latency.

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
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Callable, NamedTuple, Sequence

from tinypipe.errors import ConfigError
from tinypipe.memory.device_pool import ASSIST_CHUNK_NUMEL
from tinypipe.planner.assist import (
    ASSIST_DOWN_BYTES,
    ASSIST_UP_BYTES,
    assistable,
    assisted_upload,
    choose_assisted,
)
from tinypipe.planner.clipped import RaceResult, RaceUpload, StashMove, race_forward_end
from tinypipe.planner.dram import clipped_forward_dram
from tinypipe.planner.hardware import HardwareSpec
from tinypipe.planner.host_lane import ARRIVAL_TIME, Arrival, BackwardOrder, lane_end_s
from tinypipe.planner.kept import kept_bytes
from tinypipe.planner.offload import SsdTraffic, ssd_traffic

#: Why the SSD's reads and writes are one lane, not two: a disk shares its bandwidth between the two
#: directions. Measured, a step that read and wrote took the serial time, not the longer of the two
#: (docs/measured.md).
SSD_SHARED_NOTE = "one disk serves reads and writes"
from tinypipe.planner.sizes import ModelSizes
from tinypipe.quant.cost import dequant_seconds, passes_per_step
from tinypipe.schedule.plan import Plan

#: Tokens at which a micro-batch runs at half its asymptotic rate (fitted on two micro-batch sizes,
#: docs/measured.md).
EFFICIENCY_T0 = 684.0
#: Micro-batch size (tokens) at which ``HardwareSpec.bf16_tflops`` is quoted.
REFERENCE_TOKENS = 8192.0
#: Head throughput relative to the blocks (measured, docs/measured.md).
HEAD_EFFICIENCY = 0.87
#: A block's forward (and its recompute) per FLOP relative to its backward, on the efficiency curve
#: (a measured profile times each pass itself): the backward adds memory-bound work per FLOP
#: (attention's backward, the elementwise gradients). Fitted on the forward and recompute compute
#: of traced runs, whose backward sat on the hardware's rate; checked out of sample on runs of a
#: larger model (``python bench/archive/refit_compute.py``, docs/measured.md).
FORWARD_RATE_FACTOR = 1.125
#: Fixed cost per pack execution (forward or backward), seconds.
PACK_OVERHEAD_S = 2.1e-3
#: Speed-up of the block work per extra device: fitted on one two-GPU run (docs/measured.md).
#: Pipeline bubbles and host-side contention between the lanes are folded into it.
MULTI_DEVICE_SCALING = 0.36
#: Block and head work inside the running pipeline vs the same work timed alone by
#: ``tinypipe profile``: the lanes' host threads contend (GIL, launch gaps) and copies share
#: memory bandwidth. Fitted on one run, and checked on the other plans measured beside it
#: (docs/measured.md).
PROFILE_IN_PIPELINE = 1.136
#: Seconds per parameter of AdamW on the device (``Config.device_optimizer``): ~30 bytes of HBM
#: traffic per parameter (fp32 master, gradient, two moments read; three written; the compute
#: copy written) at ~2 TB/s achieved. Milliseconds for an embedding -- only its order matters.
DEVICE_ADAMW_S_PER_PARAM = 1.5e-11
#: Host AdamW rate of a clipped step's leftover pass (every host-stepped layer waits for the global
#: norm, then runs in the background ahead of the next forward, :mod:`tinypipe.planner.clipped`)
#: relative to the profiled rate: the pass moves the retained gradient too and shares DRAM with the
#: uploads and the cores with the lanes. Fitted together with FORWARD_RATE_FACTOR (the pass races
#: the forward) on the median of several clipped runs by ``bench/archive/refit_clipped.py``, and
#: checked out of sample on a larger model's (docs/measured.md).
CLIPPED_ADAMW_EFFICIENCY = 0.900
#: Host AdamW rate beside an unclipped backward relative to the rate measured alone
#: (``HardwareSpec.cpu_adamw_gparams_s``): the lane shares the cores with the threads that launch
#: and wait for the devices' work, and it runs slower with fewer threads. It sets how far the lane
#: lags behind the backward (:mod:`tinypipe.planner.host_lane`). Fitted on the exposed tail of one
#: plan's steps, checked out of sample on others (docs/measured.md).
BACKWARD_ADAMW_EFFICIENCY = 0.8
#: Bytes per parameter moved each way (fp32 master weights up, fp32 gradients down).
UPLOAD_BYTES = 4
DOWNLOAD_BYTES = 4


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


def _rate(hw: HardwareSpec, precision: str, tokens: float) -> float:
    """Achieved FLOP/s for a micro-batch of ``tokens``: below the reference size efficiency drops
    as T / (T + T0); above it the rate is held at the hardware's figure (not extrapolated)."""
    reference = REFERENCE_TOKENS / (REFERENCE_TOKENS + EFFICIENCY_T0)
    eff = min(1.0, (tokens / (tokens + EFFICIENCY_T0)) / reference)
    return hw.tflops(precision) * 1e12 * eff


@lru_cache(maxsize=256)
def pack_stats(sizes: ModelSizes, packs: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, int, int], ...]:
    """Per pack: (sum of flat numels, largest block numel, sum of raw parameter counts)."""
    return tuple((sum(sizes.block_numels[b] for b in p), max(sizes.block_numels[b] for b in p),
                  sum(sizes.block_params[b] for b in p)) for p in packs)


@dataclass(slots=True)
class _Rates:
    """What the plan's work runs at: FLOP/s per kind of compute, bytes/s per link, parameters/s of
    host AdamW."""

    forward: float
    recompute: float
    backward: float
    kept_backward: float  # a kept pack's backward: one forward micro-batch's graph at a time
    head: float
    h2d: float
    d2h: float
    bidir: float
    adamw: float
    backward_adamw: float  # the host lane beside an unclipped backward (BACKWARD_ADAMW_EFFICIENCY)


def _rates(hw: HardwareSpec, precision: str, seq: int, tf: int, tb: int) -> _Rates:
    """The efficiency curve at the forward (``tf``) and backward (``tb``) micro-batch tokens, or the
    measured per-layer times where the hardware has a profile at this precision."""
    rf = _rate(hw, precision, tf) * FORWARD_RATE_FACTOR
    rkb = _rate(hw, precision, tf)  # a kept pack's backward: the backward's rate at forward micro-batches
    rbw = _rate(hw, precision, tb)
    rrc = rbw * FORWARD_RATE_FACTOR
    rhead = hw.tflops(precision) * 1e12 * HEAD_EFFICIENCY
    prof = hw.layer_profile
    if prof is not None and prof.precision == precision:  # measured per-layer times (tinypipe profile)
        rf = prof.rate("forward", seq, tf) / PROFILE_IN_PIPELINE
        rrc = prof.rate("recompute", seq, tb) / PROFILE_IN_PIPELINE
        rbw = prof.rate("backward", seq, tb) / PROFILE_IN_PIPELINE
        rkb = prof.rate("backward", seq, tf) / PROFILE_IN_PIPELINE
        rhead = prof.rate("head", seq, tf) / PROFILE_IN_PIPELINE or rhead
    return _Rates(forward=rf, recompute=rrc, backward=rbw, kept_backward=rkb, head=rhead,
                  h2d=hw.h2d_gbs * 1e9, d2h=hw.d2h_gbs * 1e9, bidir=hw.bidir_gbs * 1e9,
                  adamw=hw.cpu_adamw_gparams_s * 1e9,
                  backward_adamw=hw.cpu_adamw_gparams_s * 1e9 * BACKWARD_ADAMW_EFFICIENCY)


class _Packs:
    """The plan's packs as the links see them, per pack ``q``: ``numel[q]``, trainable ``train[q]``
    and upload bytes ``up[q]``. Under LoRA only the adapters train: frozen weights upload at compute
    precision (``frozen_bytes`` per element) and only adapter gradients come down. Computed once:
    the search evaluates thousands of plans."""

    __slots__ = ("sizes", "plan", "stats", "frozen_bytes", "numel", "train", "up", "pack_of")

    def __init__(self, sizes: ModelSizes, plan: Plan, stats: tuple[tuple[int, int, int], ...],
                 frozen_bytes: int) -> None:
        trains = sizes.layer_train_numels
        self.sizes, self.plan, self.stats, self.frozen_bytes = sizes, plan, stats, frozen_bytes
        self.numel = [st[0] for st in stats]
        self.train = [sum(trains[1 + b] for b in p) for p in plan.packs]
        self.up = [t * UPLOAD_BYTES + (n - t) * frozen_bytes for n, t in zip(self.numel, self.train)]
        self.pack_of = {1 + b: q for q, p in enumerate(plan.packs) for b in p}  # layer -> its pack

    def layer_up(self, n: int, t: int) -> int:
        """Upload bytes of one layer of ``n`` elements of which ``t`` train."""
        return t * UPLOAD_BYTES + (n - t) * self.frozen_bytes

    def exposed(self, q: int, h2d: float) -> float:
        """Uploads of pack q that cannot start before the previous pack on its device releases its
        slots (only W slots are free beforehand); pack q's first micro-batch waits for them."""
        extra = len(self.plan.packs[q]) - self.plan.prefetch_window
        if extra <= 0:
            return 0.0
        return extra * self.stats[q][1] * (self.up[q] / max(1, self.numel[q])) / h2d


@dataclass(slots=True)
class _Lanes:
    """Per device: compute-lane seconds and link bytes of the forward and the backward pass."""

    f_comp: list[float]
    b_comp: list[float]
    f_up: list[float]
    b_up: list[float]
    down: list[float]
    f_down: list[float]  # host-stashed pack inputs written down in the forward
    # each pack's backward seconds on its device, by pack: when its gradients reach the host lane
    # (after a micro-batch-wise turn, Plan.turn_packs, all the turn's at its end: host_lane.py)
    b_pack: list[float] = field(default_factory=list)

    def with_backward_links(self, b_up: list[float], down: list[float]) -> _Lanes:
        """These lanes with the backward's link bytes replaced (dataclasses.replace, without its
        cost: the assist search calls it per layer tried)."""
        return _Lanes(self.f_comp, self.b_comp, self.f_up, b_up, down, self.f_down, self.b_pack)


def _pack_work(packs: _Packs, fwd_flops: list[float], rates: _Rates, lora: bool,
               dequant: list[tuple[float, float]]) -> _Lanes:
    """Each pack's compute on its forward and backward device (``dequant``: QLoRA's dequantization
    seconds per pack, forward and backward), and the uploads and gradient downloads of the packs
    that move (resident packs never do)."""
    plan = packs.plan
    n, P, R = plan.num_devices, plan.num_packs, plan.resident_packs
    bwd_mult = 1.0 if lora else 2.0  # the backward skips the frozen weights' gradient GEMMs
    # packs whose weights stay in their slots for the backward: the turn's, else the last pack
    turn = set(plan.turn())
    carried = turn or ({P - 1} if plan.fwd_device[P - 1] == plan.bwd_device[P - 1] else set())
    lanes = _Lanes(*([0.0] * n for _ in range(6)))
    for q in range(P):
        df, db = plan.fwd_device[q], plan.bwd_device[q]
        res = q < R
        lanes.f_comp[df] += fwd_flops[q] / rates.forward + PACK_OVERHEAD_S + dequant[q][0] + (
            packs.exposed(q, rates.h2d) if q > 0 and not res else 0.0)
        if plan.kept(q):  # no recompute: the forward's graph, one forward micro-batch at a time
            pass_s = bwd_mult * fwd_flops[q] / rates.kept_backward
        else:
            pass_s = fwd_flops[q] / rates.recompute + bwd_mult * fwd_flops[q] / rates.backward
        b_s = pass_s + PACK_OVERHEAD_S + dequant[q][1] + (
            packs.exposed(q, rates.h2d) if q not in carried and not res else 0.0)
        lanes.b_comp[db] += b_s
        lanes.b_pack.append(b_s)
        if res:
            continue
        lanes.f_up[df] += packs.up[q]
        if q not in carried:
            lanes.b_up[db] += packs.up[q]
        lanes.down[db] += packs.train[q] * DOWNLOAD_BYTES
    return lanes


def _dequant_work(sizes: ModelSizes, plan: Plan, batch: int, hw: HardwareSpec) -> list[tuple[float, float]]:
    """QLoRA: seconds each pack spends dequantizing its base weights, in the forward and in the
    backward (one dequantization per micro-batch pass; zeros without a quantized base)."""
    if not sizes.quant_block_params:
        return [(0.0, 0.0)] * plan.num_packs
    dq_f, dq_b = passes_per_step(batch, plan.micro_batch_size, plan.backward_micro_batch_size)
    out = []
    for q, p in enumerate(plan.packs):
        qparams = sum(sizes.quant_block_params[b] for b in p)
        # a kept pack's backward dequantizes once per forward micro-batch (the input gradient only)
        out.append((dequant_seconds(qparams, dq_f, hw.bf16_tflops),
                    dequant_seconds(qparams, dq_f if plan.kept(q) else dq_b, hw.bf16_tflops)))
    return out


def _add_stash_traffic(lanes: _Lanes, plan: Plan, stash_bytes: int) -> None:
    """Host-stashed pack inputs: written down and read back up in the forward, read up in the
    backward (unless the pack keeps its activations)."""
    P = plan.num_packs
    for q in range(1, P + 1):
        if q < len(plan.stash_on_host) and plan.stash_on_host[q]:
            lanes.f_down[plan.fwd_device[q - 1]] += stash_bytes
            reader = plan.fwd_device[q] if q < P else plan.head_device
            lanes.f_up[reader] += stash_bytes
            if q < P and not plan.kept(q):  # a kept pack's backward reads no stash
                lanes.b_up[plan.bwd_device[q]] += stash_bytes


def _add_host_kept_traffic(lanes: _Lanes, plan: Plan, held: Sequence[int]) -> None:
    """Kept graphs in host memory (``Plan.kept_on_host``): pack ``q``'s saved activations
    (``held[q]`` bytes) go down in its forward and come back up in its backward."""
    for q in range(plan.num_packs):
        if plan.on_host(q):
            lanes.f_down[plan.fwd_device[q]] += held[q]
            lanes.b_up[plan.bwd_device[q]] += held[q]


def _fill_s(packs: _Packs, embed_dev: bool, head_dev: bool, h2d: float) -> float:
    """Before the first pack computes: the resident embedding/head uploads, then the first pack's
    layers, on the devices that need them first."""
    plan, sizes, trains = packs.plan, packs.sizes, packs.sizes.layer_train_numels
    e, h = plan.embed_device, plan.head_device
    first = plan.fwd_device[0]
    resident_up = (0 if embed_dev else packs.layer_up(sizes.embed_numel, trains[0])) + (
        packs.layer_up(sizes.head_numel, trains[-1]) if h == e and not head_dev else 0)
    fill = (resident_up if first == e else 0) / h2d + (0 if plan.resident_packs else packs.up[0]) / h2d
    if first != e:
        fill = max(fill, resident_up / h2d)
    return fill


@dataclass(slots=True)
class _OnDevice:
    """Layers stepped on their device (``device_optimizer``, resident packs): no upload, no
    download, no host AdamW."""

    embed: bool
    head: bool
    resident_train: int  # trainable elements of the resident packs
    train: int  # all trainable elements stepped on a device


def _on_device(packs: _Packs) -> _OnDevice:
    plan, trains = packs.plan, packs.sizes.layer_train_numels
    embed = 0 in plan.device_optimized(plan.embed_device)
    head = plan.num_blocks + 1 in plan.device_optimized(plan.head_device)
    resident_train = sum(packs.train[q] for q in range(plan.resident_packs))
    train = (trains[0] if embed else 0) + (trains[-1] if head else 0) + resident_train
    return _OnDevice(embed, head, resident_train, train)


@lru_cache(maxsize=1024)
def _race_order(sizes: ModelSizes, pack_list: tuple[tuple[int, ...], ...], fwd_device: tuple[int, ...],
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
def _assisted_order(sizes: ModelSizes, pack_list: tuple[tuple[int, ...], ...], fwd_device: tuple[int, ...],
                    embed_device: int, head_device: int, resident: int, embed_on_device: bool,
                    head_on_device: bool, frozen_bytes: int) -> tuple[RaceUpload | None, ...]:
    """Per upload of :func:`_race_order` (the same arguments) its assisted form (None: nothing
    trains in it); cached like the order itself."""
    numels = sizes.layer_numels
    order = _race_order(sizes, pack_list, fwd_device, embed_device, head_device, resident, embed_on_device,
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


def _clipped_race(w: _Work, dev: _OnDevice) -> ClippedRace:
    """The race of ``w``'s plan: its uploads in order, the assisted ones as such."""
    packs, rates = w.packs, w.rates
    plan = packs.plan
    key = (plan.packs, plan.fwd_device, plan.embed_device, plan.head_device, plan.resident_packs, dev.embed,
           dev.head, packs.frozen_bytes)
    plain = _race_order(packs.sizes, *key)
    alternatives = _assisted_order(packs.sizes, *key)
    uploads = plain
    if plan.assisted:
        assisted = set(plan.assisted)
        uploads = tuple(a if u.layer in assisted and a is not None else u
                        for u, a in zip(plain, alternatives))
    P, n = plan.num_packs, plan.num_devices
    reads: list[StashMove | None] = [None] * P
    writes: list[StashMove | None] = [None] * P
    for q in range(1, P):  # pack q's host-stashed input: written by pack q - 1's forward, read by q's
        if q < len(plan.stash_on_host) and plan.stash_on_host[q]:
            writes[q - 1] = (plan.fwd_device[q - 1], w.stash_bytes)
            reads[q] = (plan.fwd_device[q], w.stash_bytes)
    # each pack's forward compute, the N devices' share of it as in the forward phase
    pack_fwd = tuple((w.fwd_flops[q] / rates.forward + PACK_OVERHEAD_S + w.dequant[q][0]) * w.slowdown / n
                     for q in range(P))
    kwargs = dict(slots=plan.param_slots(), devices=n, h2d=rates.h2d, d2h=rates.d2h, bidir=rates.bidir,
                  adamw_rate=rates.adamw * CLIPPED_ADAMW_EFFICIENCY, stash_reads=tuple(reads),
                  stash_writes=tuple(writes), chunk_down_bytes=ASSIST_CHUNK_NUMEL * ASSIST_DOWN_BYTES)
    return ClippedRace(uploads, alternatives, pack_fwd, kwargs)


def _deferred_forward_end(w: _Work, dev: _OnDevice, deferred: tuple[int, ...]) -> float:
    """When an unclipped step's forward ends with ``deferred`` layers' host AdamW left over from
    the step before (``Plan.deferred``): the clipped race with only their updates to run ahead of
    their uploads (the others were stepped in the backward)."""
    race = _clipped_race(w, dev)
    keep = set(deferred)
    uploads = tuple(u if u.layer in keep else dataclasses.replace(u, host_numel=0) for u in race.uploads)
    return race_forward_end(uploads, race.pack_forward_s, **race.kwargs).forward_end_s


def clipped_race(sizes: ModelSizes, plan: Plan, hw: HardwareSpec, *, batch: int, seq: int,
                 precision: str = "bf16") -> ClippedRace:
    """The inputs of ``plan``'s clipped race (what :func:`predict_step_time` runs for
    ``StepTime.clipped_step_s``), for choosers that walk it and tests."""
    w = _Work.of(sizes, plan, hw, batch=batch, seq=seq, precision=precision)
    return _clipped_race(w, _on_device(w.packs))


@dataclass(slots=True)
class _Work:
    """A plan's work at a workload: the rates it runs at, each pack's forward FLOPs, the packs as
    the links see them, QLoRA's dequantization, a host-stashed input's bytes and the slowdown of
    N devices sharing the blocks."""

    rates: _Rates
    fwd_flops: list[float]
    packs: _Packs
    dequant: list[tuple[float, float]]
    stash_bytes: int
    slowdown: float

    @staticmethod
    def of(sizes: ModelSizes, plan: Plan, hw: HardwareSpec, *, batch: int, seq: int, precision: str) -> _Work:
        tokens = batch * seq
        rates = _rates(hw, precision, seq, tf=min(plan.micro_batch_size, batch) * seq,
                       tb=min(plan.backward_micro_batch_size, batch) * seq)
        attn_per_token = 2.0 * seq * sizes.num_heads * sizes.head_dim  # causal QK^T + AV, forward
        stats = pack_stats(sizes, plan.packs)
        fwd_flops = [(2.0 * st[2] + attn_per_token * len(p)) * tokens for st, p in zip(stats, plan.packs)]
        elem = 2 if precision == "bf16" else 4
        packs = _Packs(sizes, plan, stats, frozen_bytes=elem)
        n = plan.num_devices
        # N devices share the block work; measured scaling is well below N (see MULTI_DEVICE_SCALING)
        slowdown = n / (1.0 + (n - 1) * MULTI_DEVICE_SCALING)
        return _Work(rates, fwd_flops, packs, _dequant_work(sizes, plan, batch, hw),
                     tokens * sizes.hidden * elem, slowdown)


def _layer_devices(plan: Plan, pack_devices: tuple[int, ...]) -> dict[int, int]:
    """Layer id -> its device: the embedding's and the head's, each block its pack's in
    ``pack_devices`` (the forward's or the backward's placement; empty: one device)."""
    where = {0: plan.embed_device, plan.num_blocks + 1: plan.head_device}
    for q, p in enumerate(plan.packs):
        for b in p:
            where[b + 1] = pack_devices[q] if pack_devices else 0
    return where


def _assist_bytes(packs: _Packs, lanes: _Lanes, assisted: tuple[int, ...]) -> tuple[_Lanes, int]:
    """The forward's link bytes with the extra upload and the download of the ``assisted`` layers:
    (per-device lanes, the extra bytes of the layers the fill uploads)."""
    plan, trains = packs.plan, packs.sizes.layer_train_numels
    if not assisted:
        return lanes, 0
    f_up, f_down = list(lanes.f_up), list(lanes.f_down)
    extra_up = ASSIST_UP_BYTES - UPLOAD_BYTES
    head_id = plan.num_blocks + 1
    where = _layer_devices(plan, plan.fwd_device)
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


def _forward_terms(lanes: _Lanes, slowdown: float, rates: _Rates) -> dict[str, float]:
    """The forward pass's limits: the busiest device's compute, uploads, stash writes, both links."""
    return {"compute": max(lanes.f_comp) * slowdown, "upload": max(lanes.f_up) / rates.h2d,
            "stash download": max(lanes.f_down) / rates.d2h,
            "link (both directions)": max(u + d for u, d in zip(lanes.f_up, lanes.f_down)) / rates.bidir}


def _backward_terms(lanes: _Lanes, slowdown: float, rates: _Rates) -> dict[str, float]:
    """The backward pass's limits on the devices and links (the host AdamW lane beside it is
    :func:`_host_lane`)."""
    return {
        "compute": max(lanes.b_comp) * slowdown,
        "upload": max(lanes.b_up) / rates.h2d,
        "download": max(lanes.down) / rates.d2h,
        "link (both directions)": max(u + d for u, d in zip(lanes.b_up, lanes.down)) / rates.bidir,
    }


def _host_lane(packs: _Packs, order: BackwardOrder, dev: _OnDevice, backward_s: float,
               off_host: frozenset[int], last_chunk_s: float) -> list[Arrival]:
    """The host AdamW lane's work in the backward, as it arrives (:mod:`tinypipe.planner.host_lane`;
    ``order``: the lanes' ``b_pack``). Not on the lane: the resident packs, the device-stepped
    embedding / head, and ``off_host`` (deferred and assisted layers). The head's gradient is down
    before the backward starts, the embedding's after it."""
    plan, trains = packs.plan, packs.sizes.layer_train_numels
    R = plan.resident_packs
    host = [0] * R + packs.train[R:]
    for layer in off_host:
        q = packs.pack_of.get(layer)
        if q is not None and q >= R:
            host[q] -= trains[layer]
    arrivals = order.arrivals(host, backward_s, last_chunk_s)
    if not dev.head and plan.num_blocks + 1 not in off_host:
        arrivals.append(Arrival(0.0, trains[-1]))
    if not dev.embed and 0 not in off_host:
        arrivals.append(Arrival(backward_s + last_chunk_s, trains[0]))
    return arrivals


#: Bytes per parameter an assisted layer moves right after its backward (no clipping: the download
#: task steps it, runtime/optim/assist.py): master and moments up, and down instead of the fp32 gradient.
#: Least share of the step an unclipped step's assisted layers must save for the planner to choose
#: them. 5 %: assists the model priced 3-4 % faster measured no gain, and assisting a turn's layers
#: measured slower (their H2D shares the link with the next packs' uploads) (docs/measured.md).
UNCLIPPED_ASSIST_MIN_GAIN = 0.05
#: Host seconds per assisted chunk (``ASSIST_CHUNK_NUMEL`` elements) an unclipped step adds to its
#: backward: about eight launches on the d2h lane's thread, which holds the GIL the compute lanes'
#: launches need. Not measured: an estimate at ~4 us a
#: launch. It also makes a plan that needs no assist win over one that ties with it only by it.
ASSIST_CHUNK_HOST_S = 3e-5
BACKWARD_ASSIST_UP_BYTES = 12
BACKWARD_ASSIST_DOWN_BYTES = 12


def _tail_layers(plan: Plan) -> frozenset[int]:
    """The layers whose host AdamW trails the last backward: the embedding and the lowest
    host-stepped pack's (their gradients are the step's last)."""
    R = plan.resident_packs
    return frozenset({0} | ({b + 1 for b in plan.packs[R]} if R < plan.num_packs else set()))


@dataclass(frozen=True)
class _BackwardAssist:
    """Where an unclipped step's assisted layers land: per layer its backward device, trainable
    elements and whether its update trails the backward (pack 0 / the embedding: the tail)."""

    device: dict[int, int]
    train: dict[int, int]
    tail: frozenset[int]

    @staticmethod
    def of(packs: _Packs, dev: _OnDevice) -> _BackwardAssist:
        plan, trains = packs.plan, packs.sizes.layer_train_numels
        where = _layer_devices(plan, plan.bwd_device)
        return _BackwardAssist(where, {layer: trains[layer] for layer in where}, _tail_layers(plan))

    def apply(self, lanes: _Lanes, layers: tuple[int, ...], rates: _Rates,
              prefixes: dict[tuple[int, ...], _AssistSums] | None = None) -> tuple[_Lanes, float, float]:
        """The lanes with ``layers``' round trips on the links, the tail layers' round trips
        (they trail the last backward, as their host steps would) in seconds, and the host
        seconds their chunks' launches add to the backward. ``prefixes``: the sums of earlier
        calls on the same ``lanes``, by layers; the search adds one layer at a time, so a call
        extends its prefix's sums (the same additions in the same order: the same floats)."""
        start = prefixes.get(layers[:-1]) if prefixes is not None else None
        todo = layers[-1:] if start is not None else layers
        b_up, down, tail_link, chunks = start or _AssistSums(lanes.b_up, lanes.down, 0.0, 0)
        b_up, down = list(b_up), list(down)
        for layer in todo:
            d, t = self.device[layer], self.train[layer]
            chunks += -(-t // ASSIST_CHUNK_NUMEL)
            if layer in self.tail:
                trip = max(BACKWARD_ASSIST_UP_BYTES / rates.h2d, BACKWARD_ASSIST_DOWN_BYTES / rates.d2h)
                tail_link += t * trip
                continue
            b_up[d] += t * BACKWARD_ASSIST_UP_BYTES
            down[d] += t * (BACKWARD_ASSIST_DOWN_BYTES - DOWNLOAD_BYTES)
        if prefixes is not None:
            prefixes[layers] = _AssistSums(b_up, down, tail_link, chunks)
        return lanes.with_backward_links(b_up, down), tail_link, chunks * ASSIST_CHUNK_HOST_S


class _AssistSums(NamedTuple):
    """:meth:`_BackwardAssist.apply`'s running sums: per device the backward's upload and download
    bytes, the tail layers' round-trip seconds, the chunks launched."""

    b_up: list[float]
    down: list[float]
    tail_link: float
    chunks: int


def _choose_backward_assist(bwd: _BackwardAssist, allowed: frozenset[int], base: float,
                            cost: Callable[[tuple[int, ...]], float]) -> tuple[int, ...]:
    """The layers to assist right after their backward: in backward order while each makes the
    backward + tail (``cost``; ``base`` with none) shorter -- they all move the same terms, so the
    first that does not help ends them (the search prices thousands of plans) -- then each tail
    layer (pack 0, the embedding: its round trip is exposed) that still helps."""
    layers: tuple[int, ...] = ()
    best = base
    for layer in sorted(bwd.device, reverse=True):
        # less than a chunk (a tied head's final norm): its round trip costs more than it saves
        if layer not in allowed or bwd.train[layer] < ASSIST_CHUNK_NUMEL or layer in bwd.tail:
            continue
        t = cost(layers + (layer,))
        if t >= best - 1e-6:
            break
        layers, best = layers + (layer,), t
    for layer in sorted(bwd.tail):
        if layer in allowed and bwd.train[layer] >= ASSIST_CHUNK_NUMEL:
            t = cost(layers + (layer,))
            if t < best - 1e-6:
                layers, best = layers + (layer,), t
    return layers


def recompute_seconds(sizes: ModelSizes, plan: Plan, hw: HardwareSpec, *, batch: int, seq: int,
                      precision: str = "bf16") -> list[float]:
    """Per pack: the seconds of its backward's recompute (its forward's FLOPs at the backward
    micro-batch's recompute rate) -- what keeping its activations saves."""
    rates = _rates(hw, precision, seq, tf=min(plan.micro_batch_size, batch) * seq,
                   tb=min(plan.backward_micro_batch_size, batch) * seq)
    attn_per_token = 2.0 * seq * sizes.num_heads * sizes.head_dim
    stats = pack_stats(sizes, plan.packs)
    return [(2.0 * st[2] + attn_per_token * len(p)) * batch * seq / rates.recompute
            for st, p in zip(stats, plan.packs)]


def predict_step_time(sizes: ModelSizes, plan: Plan, hw: HardwareSpec, *, batch: int, seq: int,
                      precision: str = "bf16", clipping: bool = True, assist: bool = False) -> StepTime:
    """Seconds per optimizer step of ``plan`` for ``batch`` sequences of ``seq`` tokens (``clipping``:
    also of a step where global-norm clipping triggers, ``StepTime.clipped_step_s``, with
    ``plan.assisted``; without ``clipping`` the assisted layers are stepped after their backward).
    ``assist``: choose the layers to assist instead (``plan.assisted`` is ignored) -- under
    ``clipping`` those whose clipped step raced with them is shorter
    (:func:`tinypipe.planner.assist.choose_assisted`), without it those that shorten the backward
    and tail (:func:`_choose_backward_assist`): ``StepTime.assisted``."""
    if assist and plan.assisted:
        plan = dataclasses.replace(plan, assisted=())
    P, R = plan.num_packs, plan.resident_packs
    tokens = batch * seq
    w = _Work.of(sizes, plan, hw, batch=batch, seq=seq, precision=precision)
    rates, fwd_flops, packs, dequant = w.rates, w.fwd_flops, w.packs, w.dequant
    trains = sizes.layer_train_numels
    lora = bool(sizes.frozen_total)

    lanes = _pack_work(packs, fwd_flops, rates, lora, dequant)
    _add_stash_traffic(lanes, plan, stash_bytes=w.stash_bytes)
    if plan.kept_on_host:
        held = [kept_bytes(sizes, plan, q, batch=batch, seq=seq, precision=precision)
                if plan.on_host(q) else 0 for q in range(P)]
        _add_host_kept_traffic(lanes, plan, held)
    dev = _on_device(packs)
    lanes.down[plan.embed_device] += 0 if dev.embed else trains[0] * DOWNLOAD_BYTES
    lanes.down[plan.head_device] += 0 if dev.head else trains[-1] * DOWNLOAD_BYTES
    fill = _fill_s(packs, dev.embed, dev.head, rates.h2d)

    slowdown = w.slowdown
    f_terms = _forward_terms(lanes, slowdown, rates)
    forward = max(f_terms.values())
    head = (4.0 if lora else 6.0) * sizes.head_matmul_params * tokens / rates.head

    last_chunk = sizes.grad_slot_numel * DOWNLOAD_BYTES / rates.d2h
    b_terms = _backward_terms(lanes, slowdown, rates)
    no_opt = max(b_terms.values())
    ssd = _SsdLanes(ssd_traffic(sizes, plan, precision), hw)
    if ssd.on:  # state on the SSD: read/write lanes beside every phase (see _SsdLanes)
        fill += ssd.t.fill_read / ssd.read
        # one disk: its reads and the previous step's tail writes, still landing, share it
        f_terms["ssd"] = ssd.t.forward_read / ssd.read + ssd.t.carry_write / ssd.write
        forward = max(f_terms.values())
    # deferred layers (Plan.deferred) are stepped in the next forward instead: off the backward's
    # host lane, racing that forward below
    deferred = frozenset(plan.deferred)
    bwd: _BackwardAssist | None = None
    order = BackwardOrder.of(lanes.b_pack, plan.turn())  # the assist search re-prices the backward
    prefixes: dict[tuple[int, ...], _AssistSums] = {}  # its sums so far (_BackwardAssist.apply)

    def backward_and_tail(layers: tuple[int, ...]) -> tuple[dict[str, float], float, float, _Lanes]:
        """With ``layers`` assisted right after their backward: the backward's terms, its seconds,
        the tail after it (the host lane's leftover, the tail layers' round trips, the SSD's tail
        writes) and the lanes with the round trips' bytes."""
        a_lanes, tail_link, launch_s = (lanes, 0.0, 0.0)
        if bwd is not None and layers:
            a_lanes, tail_link, launch_s = bwd.apply(lanes, layers, rates, prefixes)
        terms = _backward_terms(a_lanes, slowdown, rates)
        if ssd.on:
            terms["ssd"] = ssd.t.backward_read / ssd.read + ssd.t.backward_write / ssd.write
        b = max(terms.values()) + launch_s
        work = _host_lane(packs, order, dev, b, deferred | frozenset(layers), last_chunk)
        work.sort(key=ARRIVAL_TIME)  # stable, as lane_end_s's own: both calls below then sort in one pass
        # the lane as the backward's limit: when it is done with what arrived during the backward
        terms["cpu optimizer"] = lane_end_s([a for a in work if a.at_s < b], rates.backward_adamw)
        tail = max(lane_end_s(work, rates.backward_adamw) - b, tail_link,
                   ssd.t.tail_write / ssd.write + last_chunk if ssd.on else 0.0)
        return terms, b, tail, a_lanes

    b_terms, backward, tail, _ = backward_and_tail(())
    unclipped_assist: tuple[int, ...] = ()
    if not clipping and (plan.assisted or assist) and R < P:  # assisted right after their backward
        bwd = _BackwardAssist.of(packs, dev)

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
                layers = _choose_backward_assist(bwd, assistable(plan), base, cost)
                if base - cost(layers) < least_gain:
                    layers = ()  # not worth the scratch, the traffic and the chunk latency left out
        if layers:  # the step's traffic includes their trips
            b_terms, backward, tail, lanes = backward_and_tail(layers)
            unclipped_assist = tuple(sorted(layers))
    tail += dev.train * DEVICE_ADAMW_S_PER_PARAM
    if plan.deferred:  # the deferred updates run ahead of the next forward's uploads of their layers
        forward = max(forward, _deferred_forward_end(w, dev, plan.deferred) - fill)
    step = fill + forward + head + backward + tail
    shared = _shared_gpu_floor(lanes, head, plan, hw, rates)
    step = max(step, shared)
    # clipping triggers: the host AdamW of every host-stepped layer waits for the global norm and
    # runs in the background ahead of the next forward, which follows it layer by layer
    clip_rate = rates.adamw * CLIPPED_ADAMW_EFFICIENCY
    clipped: float | None = None
    assisted = plan.assisted

    def roofline(layers: tuple[int, ...]) -> tuple[float, dict[str, float]]:
        """The fill and the forward's terms of a clipped step with ``layers`` assisted: their bytes
        on the links."""
        a_lanes, fill_extra = _assist_bytes(packs, lanes, layers)
        terms = dict(f_terms, **(_forward_terms(a_lanes, slowdown, rates) if layers else {}))
        return fill + fill_extra / rates.h2d, terms

    def dram_floor(layers: tuple[int, ...]) -> float:
        """The forward after a clipped step moves the host-held layers' state through host memory
        (:mod:`tinypipe.planner.dram`): no shorter than its bytes at the host's DRAM rate."""
        if not hw.host_dram_gbs:
            return 0.0
        win = clipped_forward_dram(sizes, plan, stash_bytes=w.stash_bytes, upload_bytes=UPLOAD_BYTES,
                                   frozen_bytes=packs.frozen_bytes, assisted=layers)
        return win.seconds(hw.host_dram_gbs)

    def raced(layers: tuple[int, ...], race: RaceResult) -> float:
        a_fill, terms = roofline(layers)
        # the head runs once the forward is done and its own update and upload are, and the
        # assisted layers' state is back down
        ends = (race.forward_end_s, race.uploads_end_s, race.downloads_end_s, dram_floor(layers))
        return (max(a_fill + max(terms.values()), *ends) + head + no_opt + last_chunk
                + dev.train * DEVICE_ADAMW_S_PER_PARAM)

    if clipping and ssd.on:  # the SSD's lanes beside the pass (see _SsdLanes.clipped)
        a_fill, a_terms = roofline(assisted)
        host_pass = (sizes.train_total - dev.train - sum(trains[layer] for layer in assisted)) / clip_rate
        no_opt, host_pass = ssd.clipped(no_opt, host_pass, a_terms)
        clipped = a_fill + max(max(a_terms.values()), host_pass) + head + no_opt + last_chunk
    elif clipping:
        setup = _clipped_race(w, dev)
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


def _shared_gpu_floor(lanes: _Lanes, head: float, plan: Plan, hw: HardwareSpec, rates: _Rates) -> float:
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


class _SsdLanes:
    """The SSD as two lanes, reads and writes, each at its measured rate (``tinypipe profile``
    measures them separately, the way the tier's worker threads issue them: several requests in
    flight). Each phase of the step is as slow as its slowest lane, the SSD's included: the first
    reads of the embedding, head and first pack lengthen the fill; the other packs' first reads
    run beside the forward; second reads, moment reads and the write-backs of layers stepped
    during the backward beside the backward; the master write-backs of the tail's layers beside
    the tail's AdamW, their moment and gradient write-backs beside the next step's forward (steady
    state: the previous step's land beside this one's). A clipped step's backward moves only
    upload reads and gradients; the moment, gradient and master traffic of its redo pass runs
    beside the next forward, with that forward's reads."""

    def __init__(self, traffic: SsdTraffic, hw: HardwareSpec) -> None:
        self.t = traffic
        self.on = bool(traffic.read_bytes or traffic.write_bytes)
        if self.on and not (hw.ssd_read_gbps and hw.ssd_write_gbps):
            raise ConfigError(f"the plan keeps state on the SSD but hardware {hw.name!r} states no "
                              "ssd_read_gbps / ssd_write_gbps (tinypipe profile --offload-dir measures them)")
        self.read = (hw.ssd_read_gbps or 1.0) * 1e9
        self.write = (hw.ssd_write_gbps or 1.0) * 1e9

    def clipped(self, no_opt: float, host_pass: float, f_terms: dict[str, float]) -> tuple[float, float]:
        """(backward, background pass) of a step where clipping triggers, with the SSD's share."""
        t = self.t
        upload_reads = t.backward_read - t.step_read
        backward = max(no_opt, upload_reads / self.read, t.grad_bytes / self.write)
        redo_read = t.step_read + t.grad_bytes + t.master_bytes
        redo_write = t.step_write
        pass_s = max(host_pass, (t.forward_read + redo_read) / self.read, redo_write / self.write)
        return backward, max(pass_s, max(f_terms.values()))
