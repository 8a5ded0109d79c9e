"""The SSD tier's bookkeeping for the planner: which training state of which layer may go to the SSD,
in which order, what that frees in DRAM and adds in staging buffers, what it reads and writes per
step and in which phase of the step. Pure functions of the sizes and the plan (no I/O).

**Regions** (what the runtime allocates on the SSD, sized from the host store's
``LayerState`` tensors): per layer with ``t`` trainable and ``f`` frozen elements,
``master`` one region of 4t bytes, ``moments`` two (exp_avg, exp_avg_sq) of 4t, ``grad`` one of 4t
(retained gradients only exist under clipping / ``nonfinite="skip"``), ``frozen`` one of a*f
(a: the compute dtype's bytes). On disk each region starts on a 4 KiB boundary
(:func:`disk_bytes`, as ``SsdStateStore`` lays them out).

**Host need with offload** (:func:`tinypipe.planner.estimate.host_bytes`): every DRAM category
loses the bytes of its offloaded regions, and ``ssd_staging`` is added: the two staging pools the
runtime allocates (:func:`tinypipe.schedule.staging.staging_pools`, which walks a schedule), counted
here in closed form (:func:`staging_shape`, the same numbers: ``tests/test_ssd_staging.py`` checks
them against running engines). The upload pool holds a layer's master/frozen regions for each
layer the uploads prefetch plus the one being copied; the update pool ``read_ahead + 1`` layers'
optimizer state (moments, gradient, master of layers without a backward upload) plus, when
backward uploads read masters, a pack's masters and the prefetch window's; the store's workers add
their bounce pages (:func:`tinypipe.storage.store.bounce_bytes`, 64 KiB). Counting one uniform
pool of ``(slots per device x devices + 1) x (most regions of a layer)`` slots of the largest
region instead would count more than twice what the runtime takes for a 7B model
(docs/measured.md).

**The order** (:func:`offload_order`): kinds in :data:`OFFLOAD_ORDER` -- moments first (read and
written once per step, needed only by the host AdamW, which runs during the backward), then
retained gradients (written once, read only when clipping redoes a step), then master weights
(read twice per step, for the forward and the backward upload, written once: the forward's reads
are the hardest to hide, behind a third of the compute), then frozen LoRA weights (read twice,
never written: least DRAM freed per byte moved once the state above is gone). Within a kind, the
layers whose I/O is easiest to hide come first: the blocks from the last to the first (the last
blocks are stepped first in the backward -- their reads can run during the forward and the head,
their write-backs hide behind the rest of the backward); the first host-stepped pack's blocks are
last among the blocks (stepped after the backward, in the exposed tail, and -- for masters -- read
before the first pack can compute); then the head and the embedding, whose regions are the
largest (vocab x hidden): one of them on the SSD enlarges every staging slot, and the embedding is
stepped last and read first. Layers stepped on a device (``device_optimizer``, resident packs)
never appear in the offload set.

**Per-step traffic** (:class:`SsdTraffic`), as the runtime moves it: a layer's offloaded moments
are read ahead of its optimizer step and written back after it; offloaded master weights / frozen
weights are read ahead of each upload (forward and backward), the master written back after the
step; an offloaded gradient is written when downloaded. The embedding's, the head's (on the
embedding's device) and the first pack's first reads precede the first compute (the fill). The
layers stepped after the backward (the first host-stepped pack, the embedding) write their masters
before the next step reads them again, but their moments and gradients while it runs: nothing
reads those before that layer's next optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from tinypipe.devices.host_buffers import PAGE
from tinypipe.errors import ConfigError
from tinypipe.planner.sizes import ModelSizes, dtype_bytes
from tinypipe.schedule.plan import OFFLOAD_KINDS, OffloadKind, Plan
from tinypipe.schedule.staging import DEFAULT_READ_AHEAD, PoolShape
from tinypipe.storage.direct import align_up
from tinypipe.storage.store import bounce_bytes

#: The order in which kinds of state move to the SSD (see the module documentation).
OFFLOAD_ORDER: tuple[OffloadKind, ...] = ("moments", "grad", "master", "frozen")
#: Regions (SSD extents, staging slots) per layer and kind.
REGIONS = {"master": 1, "moments": 2, "grad": 1, "frozen": 1}
#: The host-store category each kind's DRAM bytes are counted in (``MemoryReport.host``).
CATEGORY = {"master": "master_weights", "moments": "optimizer_state", "grad": "gradient_buffers",
            "frozen": "frozen_weights"}
STAGING_CATEGORY = "ssd_staging"

def region_bytes(sizes: ModelSizes, layer: int, kind: str, precision: str) -> int:
    """Bytes of one region of ``kind`` for ``layer`` (moments: each of its two regions)."""
    train = sizes.layer_train_numels[layer]
    if kind == "frozen":
        return (sizes.layer_numels[layer] - train) * dtype_bytes(precision)
    if kind in REGIONS:
        return 4 * train
    raise ConfigError(f"offload kind must be one of {', '.join(OFFLOAD_KINDS)}, got {kind!r}")


def kind_bytes(sizes: ModelSizes, layer: int, kind: str, precision: str) -> int:
    """DRAM bytes that ``kind`` of ``layer`` takes (and frees when it moves to the SSD)."""
    return REGIONS[kind] * region_bytes(sizes, layer, kind, precision)


def device_layers(plan: Plan) -> set[int]:
    """Layers stepped on a device (never offloaded)."""
    return {layer for d in range(plan.num_devices) for layer in plan.device_optimized(d)}


def _tail_pack(plan: Plan) -> int | None:
    """The first host-stepped pack: stepped after the backward (None: every pack is resident)."""
    return plan.resident_packs if plan.resident_packs < plan.num_packs else None


def layer_order(plan: Plan) -> list[int]:
    """Offloadable layers, easiest to hide first: blocks last to first (the first host-stepped
    pack's at the end of them), then the head, then the embedding."""
    on_device = device_layers(plan)
    resident = set(plan.resident_layers())
    L = plan.num_blocks
    tail = _tail_pack(plan)
    tail_blocks = {b + 1 for b in plan.packs[tail]} if tail is not None else set()
    blocks = [layer for layer in range(L, 0, -1) if layer not in resident]
    ordered = [x for x in blocks if x not in tail_blocks] + [x for x in blocks if x in tail_blocks]
    return [x for x in ordered + [L + 1, 0] if x not in on_device]


def offload_order(sizes: ModelSizes, plan: Plan, *, retain_grads: bool) -> list[tuple[int, str]]:
    """Every (layer, kind) that may move to the SSD, in the order it moves (module documentation)."""
    layers = layer_order(plan)
    trains, numels = sizes.layer_train_numels, sizes.layer_numels
    out = []
    for kind in OFFLOAD_ORDER:
        if kind == "grad" and not retain_grads:
            continue
        for layer in layers:
            frozen = numels[layer] - trains[layer]
            if kind == "master" and frozen:  # LoRA: the adapters' masters stay in DRAM (runtime/build.py)
                continue
            if frozen if kind == "frozen" else trains[layer]:
                out.append((layer, kind))
    return out


#: The host store's region names of each kind (``tinypipe.memory.host_store.REGIONS_OF``).
REGION_NAMES = {"master": ("master",), "moments": ("exp_avg", "exp_avg_sq"), "grad": ("grad",),
                "frozen": ("frozen",)}
_UPDATE_NAMES = ("master", "exp_avg", "exp_avg_sq", "grad")  # tinypipe.schedule.staging.UPDATE_NAMES


def backward_upload_layers(plan: Plan) -> frozenset[int]:
    """Layers uploaded again for the backward: the blocks of every swapped pack except the last
    when its forward and backward share a device (its slots carry over; ``schedule/builder.py``)."""
    P = plan.num_packs
    carry = plan.fwd_device[P - 1] == plan.bwd_device[P - 1]
    return frozenset(b + 1 for q in range(plan.resident_packs, P) if not (carry and q == P - 1)
                     for b in plan.packs[q])


def _page(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


class _PoolCount:
    """The staging pools' shape, grown one (layer, kind) at a time (each layer's share only grows
    as kinds join it, so the maxima accumulate)."""

    def __init__(self, sizes: ModelSizes, plan: Plan, precision: str, read_ahead: int) -> None:
        self.sizes, self.plan, self.precision, self.read_ahead = sizes, plan, precision, read_ahead
        self.backward = backward_upload_layers(plan)
        self.names: dict[int, set[str]] = {}
        self.upload = self.upload_bytes = self.state = self.update_bytes = self.leftover = 0
        self.masters = False

    def add(self, layer: int, kind: str) -> None:
        nbytes = region_bytes(self.sizes, layer, kind, self.precision)
        if not nbytes:  # a kind the layer does not have takes no region
            return
        names = self.names.setdefault(layer, set())
        names.update(REGION_NAMES[kind])
        if kind in ("master", "frozen"):
            self.upload = max(self.upload, sum(n in names for n in ("master", "frozen")))
            self.upload_bytes = max(self.upload_bytes, nbytes)
        if kind != "frozen":
            self.update_bytes = max(self.update_bytes, nbytes)
            shared = layer in self.backward and "master" in names  # its master has a set of its own
            self.masters = self.masters or shared
            own = sum(n in names for n in _UPDATE_NAMES if not (shared and n == "master"))
            self.state = max(self.state, own)
            self.leftover = max(self.leftover, sum(n in names for n in _UPDATE_NAMES))

    def shape(self) -> PoolShape:
        plan = self.plan
        window = max(1, plan.prefetch_window)
        up = self.upload * (window * plan.num_devices + 1)
        masters = max(map(len, plan.packs)) + window if self.masters else 0
        upd = max(self.state * (self.read_ahead + 1) + masters, self.leftover)
        return PoolShape(up, _page(self.upload_bytes) if up else 0,
                         upd, _page(self.update_bytes) if upd else 0)


def staging_shape(sizes: ModelSizes, plan: Plan, offload: Iterable[tuple[int, str]] | None = None,
                  precision: str = "bf16", read_ahead: int = DEFAULT_READ_AHEAD) -> PoolShape:
    """The staging pools the runtime allocates for ``offload`` (default: the plan's); empty when
    nothing is offloaded (see the module documentation)."""
    count = _PoolCount(sizes, plan, precision, read_ahead)
    for layer, kind in plan.offload if offload is None else offload:
        count.add(layer, kind)
    return count.shape()


def staging_bytes(sizes: ModelSizes, plan: Plan, precision: str) -> int:
    """Host bytes of the SSD tier beside the store: its staging pools and the store's bounce pages
    (``ssd_staging_pool`` in the engine's memory report); 0 without offload."""
    return staging_shape(sizes, plan, precision=precision).nbytes + (bounce_bytes() if plan.offload else 0)


def apply_offload(cats: dict[str, int], sizes: ModelSizes, plan: Plan, precision: str) -> dict[str, int]:
    """The DRAM-only host categories ``cats`` with ``plan.offload`` moved to the SSD: each kind's
    bytes leave its category and the staging pool is added (``ssd_staging``)."""
    if not plan.offload:
        return cats
    out = dict(cats)
    category = dict(CATEGORY, frozen=sizes.frozen_label)  # "frozen_weights (nf4+dq)" under QLoRA
    for layer, kind in plan.offload:
        out[category[kind]] -= kind_bytes(sizes, layer, kind, precision)
    if out.get(sizes.frozen_label) == 0:  # the runtime reports the category only while it holds bytes
        del out[sizes.frozen_label]
    out[STAGING_CATEGORY] = staging_bytes(sizes, plan, precision)
    return out


def choose_offload(sizes: ModelSizes, plan: Plan, host: dict[str, int], budget: int, *, precision: str,
                   retain_grads: bool) -> tuple[tuple[int, str], ...] | None:
    """The shortest prefix of :func:`offload_order` whose host need (``host``: the DRAM-only
    categories, minus what moves, plus the staging pool) fits ``budget`` bytes; ``()`` when
    everything fits in DRAM, None when even the whole order does not fit. A smaller budget gives a
    longer prefix: the chosen sets grow monotonically as DRAM shrinks."""
    need = sum(host.values())
    if need <= budget:
        return ()
    order = offload_order(sizes, plan, retain_grads=retain_grads)
    count = _PoolCount(sizes, plan, precision, DEFAULT_READ_AHEAD)
    freed = 0
    for i, (layer, kind) in enumerate(order):
        freed += kind_bytes(sizes, layer, kind, precision)
        count.add(layer, kind)
        if need - freed + count.shape().nbytes + bounce_bytes() <= budget:
            return tuple(sorted(order[: i + 1]))
    return None


def least_host_need(sizes: ModelSizes, plan: Plan, host: dict[str, int], *, precision: str,
                    retain_grads: bool) -> int:
    """The smallest host need of any prefix of the order (for the message when none fits)."""
    order = offload_order(sizes, plan, retain_grads=retain_grads)
    need = best = sum(host.values())
    count = _PoolCount(sizes, plan, precision, DEFAULT_READ_AHEAD)
    for layer, kind in order:
        need -= kind_bytes(sizes, layer, kind, precision)
        count.add(layer, kind)
        best = min(best, need + count.shape().nbytes + bounce_bytes())
    return best


def disk_bytes(sizes: ModelSizes, offload: Iterable[tuple[int, str]], precision: str) -> int:
    """Scratch-file bytes for ``offload``: every region on a 4 KiB boundary. Frozen weights are
    counted although the runtime reads them from the model's own files when it can."""
    return sum(REGIONS[kind] * align_up(region_bytes(sizes, layer, kind, precision))
               for layer, kind in offload)


@dataclass(frozen=True)
class KindSummary:
    """One kind of state: layers holding it, and where its bytes are."""

    kind: str
    layers: int  # layers that have this kind of state (host-stepped ones for the optimizer kinds)
    on_ssd: int  # layers whose state of this kind is on the SSD
    ssd_bytes: int
    dram_bytes: int


def summary(sizes: ModelSizes, plan: Plan, precision: str, *, retain_grads: bool) -> list[KindSummary]:
    """Per kind (in :data:`OFFLOAD_ORDER`, kinds the model has): how many layers, bytes on the SSD
    and in DRAM (DRAM: the host store's bytes of that kind, all layers)."""
    off = set(plan.offload)
    possible = offload_order(sizes, plan, retain_grads=retain_grads)
    trains, numels = sizes.layer_train_numels, sizes.layer_numels
    on_device = device_layers(plan)
    out = []
    for kind in OFFLOAD_ORDER:
        if kind == "grad":
            if not retain_grads:
                continue
            layers = [x for x in range(len(trains)) if x not in on_device and trains[x]]
        elif kind == "frozen":
            layers = [x for x in range(len(trains)) if numels[x] - trains[x]]
        else:
            layers = [x for x in range(len(trains)) if trains[x]]
        if not layers:
            continue
        ssd = sum(kind_bytes(sizes, x, kind, precision) for x in layers if (x, kind) in off)
        total = sum(kind_bytes(sizes, x, kind, precision) for x in layers)
        out.append(KindSummary(kind, len(layers), sum(1 for x, k in possible if k == kind and (x, k) in off),
                               ssd, total - ssd))
    return out


@dataclass(frozen=True)
class SsdTraffic:
    """Bytes one optimizer step moves between the SSD and DRAM, by where in the step they move."""

    fill_read: int = 0  # first reads before the first pack computes (embedding, head, first pack)
    forward_read: int = 0  # first reads of the other packs, ahead of their forward uploads
    backward_read: int = 0  # second master/frozen reads (backward uploads, steps) and moment reads
    backward_write: int = 0  # write-backs of the layers stepped during the backward (and their grads)
    tail_write: int = 0  # master write-backs of the layers stepped after the backward (read by the next fill)
    carry_write: int = 0  # their moment / gradient write-backs: they land during the next step's forward
    # the part of the above that is optimizer-step traffic: what a clipped step redoes after the backward
    step_read: int = 0  # moment reads
    step_write: int = 0  # moment and master write-backs
    grad_bytes: int = 0  # offloaded gradients: written in every step, read back when a clipped step redoes
    master_bytes: int = 0  # offloaded master weights (a redo reads them once more)
    forward_write: int = 0  # pack inputs stashed on the SSD (Plan.stash_on_ssd), written in the forward

    @property
    def read_bytes(self) -> int:
        return self.fill_read + self.forward_read + self.backward_read

    @property
    def write_bytes(self) -> int:
        return self.backward_write + self.tail_write + self.carry_write + self.forward_write


def with_stash_traffic(t: SsdTraffic, plan: Plan, stash_bytes: int, host_grads: Sequence[bool]) -> SsdTraffic:
    """``t`` plus what the pack inputs stashed on the SSD (``Plan.stash_on_ssd``, ``stash_bytes``
    each) move per step, as :mod:`tinypipe.runtime.ssd_stash` moves them: written by the forward of
    the pack before, read back by the forward of the pack they feed and again by its backward; where
    the boundary's gradient lives in the stash's rows (``host_grads``: host_gradient_boundaries),
    written there by that backward and read by the previous pack's."""
    if not plan.stash_on_ssd:
        return t
    n = len(plan.stash_on_ssd)
    g = sum(1 for q in plan.stash_on_ssd if host_grads[q])
    return replace(t, forward_read=t.forward_read + n * stash_bytes, forward_write=n * stash_bytes,
                   backward_read=t.backward_read + (n + g) * stash_bytes,
                   backward_write=t.backward_write + g * stash_bytes)


def ssd_traffic(sizes: ModelSizes, plan: Plan, precision: str) -> SsdTraffic:
    """What ``plan.offload`` reads and writes per step, per phase (see the module documentation)."""
    if not plan.offload:
        return SsdTraffic()
    L = plan.num_blocks
    first = set()  # layers whose first read precedes the first compute
    first.add(0)
    if plan.head_device == plan.embed_device:
        first.add(L + 1)
    if plan.resident_packs == 0:
        first.update(b + 1 for b in plan.packs[0])
    tail = _tail_pack(plan)
    tail_layers = ({b + 1 for b in plan.packs[tail]} if tail is not None else set()) | {0}
    f = dict(fill_read=0, forward_read=0, backward_read=0, backward_write=0, tail_write=0, carry_write=0,
             step_read=0, step_write=0, grad_bytes=0, master_bytes=0)
    for layer, kind in plan.offload:
        nbytes = kind_bytes(sizes, layer, kind, precision)
        write_to = "backward_write" if layer not in tail_layers else ("tail_write" if kind == "master"
                                                                      else "carry_write")
        if kind in ("master", "frozen"):
            f["fill_read" if layer in first else "forward_read"] += nbytes
            if kind == "master" or 0 < layer <= L:  # a resident embedding/head uploads its frozen part once
                f["backward_read"] += nbytes
            if kind == "master":
                f[write_to] += nbytes
                f["step_write"] += nbytes
                f["master_bytes"] += nbytes
        elif kind == "moments":
            f["backward_read"] += nbytes
            f["step_read"] += nbytes
            f[write_to] += nbytes
            f["step_write"] += nbytes
        else:  # grad
            f[write_to] += nbytes
            f["grad_bytes"] += nbytes
    return SsdTraffic(**f)

