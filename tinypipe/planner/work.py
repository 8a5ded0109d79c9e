"""A plan's work at a workload, as the step-time model (:mod:`tinypipe.planner.cost`) sees it.

The rates the work runs at (the efficiency curve over micro-batch tokens, or a measured profile),
the packs as the links see them, each device's compute seconds and link bytes per pass (uploads,
gradient downloads, host-stashed inputs, kept graphs in host memory), the fill before the first
pack computes, the layers stepped on their device, the pass's limits, and the host AdamW lane's
work as it arrives in the backward. The constants are the model's fitted and stated rates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

from tinypipe.models.chunked_mlp import FOLDABLE, LONG_SEQUENCE_TOKENS
from tinypipe.models.segment_attention import FAMILIES as SEGMENT_FAMILIES
from tinypipe.planner.hardware import HardwareSpec
from tinypipe.planner.host_lane import Arrival, BackwardOrder
from tinypipe.planner.sizes import ModelSizes
from tinypipe.quant.cost import dequant_seconds
from tinypipe.schedule.plan import Plan, host_gradient_boundaries, host_stashed_inputs


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
#: Attention's backward FLOPs per forward FLOP, whether or not the weights train: scaled
#: dot-product attention's forward is two products (QK^T, AV), its backward five (the scores
#: recomputed, dV, dP, dQ, dK), FlashAttention-2's count. A block's other matmuls cost 1x their
#: forward in the backward when frozen (the input gradient only) and 2x when trained. It matters at
#: long sequences: at 64K tokens attention is ~55 % of an 8B block's forward FLOPs, at 2K ~4 %.
ATTENTION_BACKWARD_RATIO = 2.5
#: Fixed cost per pack execution (forward or backward), seconds.
PACK_OVERHEAD_S = 2.1e-3
#: Seconds per call of a token-chunked module (models/chunked_mlp.py: the MLP, and q/k/v with the first
#: norm folded in; four per block and chunk) per pass, beyond its FLOPs and dequantization: the GPU idles
#: while the host launches each chunk's small kernels and checkpoint, and (when it was fitted) autograd
#: gathered every chunk's input gradient into a zeroed full-sequence buffer -- a fill and an add of the
#: whole [S, hidden] per chunk, gone since 6b188ca (chunks joined by a split; the constant is to be
#: refitted from a new profile: bench/long_diagnose_device.sh runs bench/archive/fit_long_overheads.py
#: on it). Fitted on one profiled step of four 8B QLoRA blocks at 1 x 64K on an H100 (chunked step
#: minus unchunked, less what the model prices of the difference: 0.309 s over 512 calls;
#: bench/results/long_context/diagnose_f420d4828575), checked on the 32-block 2 x 64K acceptance rows it
#: was not fitted on (docs/long_context.md). A host-side cost: not scaled by the GPU's rate.
CHUNK_CALL_S = 0.60e-3
#: Seconds per query token and tile merge of tiled attention (models/tiled_attention.py), per block
#: and step (its forward, recompute and backward together) at the reference GPU rate: the eager
#: log-sum-exp merges and fp32 accumulations of a query block's tiles. A query block of a segment of
#: T tiles merges 0..T-1 times: (T - 1) / 2 merges per token on average. Fitted on the same profile
#: (tiled step minus whole-segment: 0.200 s over 4 blocks x 65,536 tokens x 3.5 merges).
TILE_MERGE_S = 218e-9
#: The rate of the preset the fitted run was priced with (h200-pcie5: H100s and H200s plan with it);
#: other GPUs scale :data:`TILE_MERGE_S` by their rate relative to it.
TILE_MERGE_REFERENCE_TFLOPS = 525.0
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
#: Host AdamW rate beside an unclipped backward relative to the rate measured alone
#: (``HardwareSpec.cpu_adamw_gparams_s``): the lane shares the cores with the threads that launch
#: and wait for the devices' work, and it runs slower with fewer threads. It sets how far the lane
#: lags behind the backward (:mod:`tinypipe.planner.host_lane`). Fitted on the exposed tail of one
#: plan's steps, checked out of sample on others (docs/measured.md).
BACKWARD_ADAMW_EFFICIENCY = 0.8
#: Bytes per parameter moved each way (fp32 master weights up, fp32 gradients down).
UPLOAD_BYTES = 4
DOWNLOAD_BYTES = 4


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
class Rates:
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


def rates_for(hw: HardwareSpec, precision: str, seq: int, tf: int, tb: int) -> Rates:
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
    return Rates(forward=rf, recompute=rrc, backward=rbw, kept_backward=rkb, head=rhead,
                  h2d=hw.h2d_gbs * 1e9, d2h=hw.d2h_gbs * 1e9, bidir=hw.bidir_gbs * 1e9,
                  adamw=hw.cpu_adamw_gparams_s * 1e9,
                  backward_adamw=hw.cpu_adamw_gparams_s * 1e9 * BACKWARD_ADAMW_EFFICIENCY)


class Packs:
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
class Lanes:
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

    def with_backward_links(self, b_up: list[float], down: list[float]) -> Lanes:
        """These lanes with the backward's link bytes replaced (dataclasses.replace, without its
        cost: the assist search calls it per layer tried)."""
        return Lanes(self.f_comp, self.b_comp, self.f_up, b_up, down, self.f_down, self.b_pack)


@dataclass(slots=True)
class Work:
    """A plan's work at a workload: the rates it runs at, each pack's forward FLOPs, the packs as
    the links see them, QLoRA's dequantization, a host-stashed input's bytes and the slowdown of
    N devices sharing the blocks."""

    rates: Rates
    fwd_flops: list[float]
    packs: Packs
    dequant: list[tuple[float, float]]
    stash_bytes: int
    slowdown: float
    #: per pack, FLOPs the backward runs again for token-chunked blocks (models/chunked_mlp.py: each
    #: chunk's norms, q/k/v projections and MLP are recomputed under its checkpoint); 0 unchunked
    chunk_flops: list[float] = field(default_factory=list)
    #: the MLPs run in chunks (long sequences): the embedding's output may be host-stashed too
    #: (:func:`~tinypipe.schedule.plan.host_stashed_inputs`)
    long_sequences: bool = False
    #: per pack, the part of ``fwd_flops`` that is attention's (its backward costs
    #: :data:`ATTENTION_BACKWARD_RATIO` times it, trained weights or not)
    attn_flops: list[float] = field(default_factory=list)
    #: per pack, (forward, backward) seconds of the long-sequence overheads outside the FLOP rates:
    #: chunked modules' calls and tiled attention's merges (:func:`long_sequence_overheads`)
    overheads: list[tuple[float, float]] = field(default_factory=list)

    @staticmethod
    def of(sizes: ModelSizes, plan: Plan, hw: HardwareSpec, *, batch: int, seq: int, precision: str,
           mlp_chunk: int = 0) -> Work:
        tokens = batch * seq
        rates = rates_for(hw, precision, seq, tf=min(plan.micro_batch_size, batch) * seq,
                       tb=min(plan.backward_micro_batch_size, batch) * seq)
        # causal QK^T + AV, forward
        attn_per_token = 2.0 * sizes.attended_tokens(seq) * sizes.num_heads * sizes.head_dim
        stats = pack_stats(sizes, plan.packs)
        fwd_flops = [(2.0 * st[2] + attn_per_token * len(p)) * tokens for st, p in zip(stats, plan.packs)]
        chunked = mlp_chunk > 0 and min(plan.backward_micro_batch_size, batch) * seq > mlp_chunk
        if chunked:  # the backward recomputes each token chunk: its blocks' matmuls but o_proj's again
            o_proj = sizes.hidden * sizes.num_heads * sizes.head_dim
            fwd_flops_again = [2.0 * (st[2] - o_proj * len(p)) * tokens for st, p in zip(stats, plan.packs)]
        else:
            fwd_flops_again = [0.0] * len(plan.packs)
        elem = 2 if precision == "bf16" else 4
        packs = Packs(sizes, plan, stats, frozen_bytes=elem)
        n = plan.num_devices
        # N devices share the block work; measured scaling is well below N (see MULTI_DEVICE_SCALING)
        slowdown = n / (1.0 + (n - 1) * MULTI_DEVICE_SCALING)
        return Work(rates, fwd_flops, packs, _dequant_work(sizes, plan, batch, hw, seq, mlp_chunk),
                     tokens * sizes.hidden * elem, slowdown, fwd_flops_again, long_sequences=mlp_chunk > 0,
                     attn_flops=[attn_per_token * len(p) * tokens for p in plan.packs],
                     overheads=long_sequence_overheads(sizes, plan, hw, batch=batch, seq=seq,
                                                       mlp_chunk=mlp_chunk))


def pack_work(packs: Packs, fwd_flops: list[float], rates: Rates, lora: bool,
               dequant: list[tuple[float, float]], chunk_flops: Sequence[float] = (),
               attn_flops: Sequence[float] = (), overheads: Sequence[tuple[float, float]] = ()) -> Lanes:
    """Each pack's compute on its forward and backward device (``dequant``: QLoRA's dequantization
    seconds per pack, forward and backward; ``attn_flops``: the attention part of ``fwd_flops``,
    see :data:`ATTENTION_BACKWARD_RATIO`; ``overheads``: the long-sequence seconds outside the
    FLOP rates, forward and backward), and the uploads and gradient downloads of the packs that
    move (resident packs never do)."""
    plan = packs.plan
    n, P, R = plan.num_devices, plan.num_packs, plan.resident_packs
    bwd_mult = 1.0 if lora else 2.0  # the backward skips the frozen weights' gradient GEMMs
    # packs whose weights stay in their slots for the backward: the turn's, else the last pack
    turn = set(plan.turn())
    carried = turn or ({P - 1} if plan.fwd_device[P - 1] == plan.bwd_device[P - 1] else set())
    lanes = Lanes(*([0.0] * n for _ in range(6)))
    for q in range(P):
        df, db = plan.fwd_device[q], plan.bwd_device[q]
        res = q < R
        extra_f, extra_b = overheads[q] if overheads else (0.0, 0.0)
        lanes.f_comp[df] += fwd_flops[q] / rates.forward + PACK_OVERHEAD_S + dequant[q][0] + extra_f + (
            packs.exposed(q, rates.h2d) if q > 0 and not res else 0.0)
        attn = attn_flops[q] if attn_flops else 0.0
        bwd_flops = bwd_mult * (fwd_flops[q] - attn) + ATTENTION_BACKWARD_RATIO * attn
        if plan.kept(q):  # no recompute: the forward's graph, one forward micro-batch at a time
            pass_s = bwd_flops / rates.kept_backward
        else:
            pass_s = fwd_flops[q] / rates.recompute + bwd_flops / rates.backward
        if chunk_flops:
            pass_s += chunk_flops[q] / rates.recompute
        b_s = pass_s + PACK_OVERHEAD_S + dequant[q][1] + extra_b + (
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


def _dequant_work(sizes: ModelSizes, plan: Plan, batch: int, hw: HardwareSpec, seq: int = 0,
                  mlp_chunk: int = 0) -> list[tuple[float, float]]:
    """QLoRA: seconds each pack spends dequantizing its base weights, in the forward and in the
    backward (zeros without a quantized base).

    bitsandbytes dequantizes a weight on every call: once per micro-batch pass, and once per token
    chunk for the weights that run in chunks at long sequences (models/chunked_mlp.py: the MLP,
    and q/k/v where the block's first norm is folded into their chunks) -- eight times per pass at
    8K-token chunks of a 64K sequence. A chunked weight's backward always recomputes its chunk
    (a checkpoint per chunk, kept pack or not), so it dequantizes twice per chunk."""
    if not sizes.quant_block_params:
        return [(0.0, 0.0)] * plan.num_packs
    n_f, n_b, c_f, c_b = _micro_batches_and_chunks(plan, batch, seq, mlp_chunk)
    unchunked_attn = sizes.hidden * sizes.num_heads * sizes.head_dim  # o_proj
    if sizes.model_type not in FOLDABLE:  # q/k/v read an unfolded norm's output: whole too
        unchunked_attn += sizes.hidden * (sizes.num_heads + 2 * sizes.num_kv_heads) * sizes.head_dim
    out = []
    for q, p in enumerate(plan.packs):
        qparams = sum(sizes.quant_block_params[b] for b in p)
        # the part of the quantized weights that run in chunks (none where nothing is chunked)
        chunked = sum(max(0, sizes.quant_block_params[b] - unchunked_attn) for b in p) if (
            c_f > 1 or c_b > 1) else 0
        whole = qparams - chunked
        fwd = n_f * (whole + chunked * c_f)
        if plan.kept(q):  # the kept graph's backward: the input gradient once per forward micro-batch
            bwd = n_f * (whole + chunked * (2 * c_f if c_f > 1 else 1))
        else:  # the recompute's forward, then the input gradient
            bwd = n_b * 2 * (whole + chunked * c_b)
        out.append((dequant_seconds(fwd, 1, hw.bf16_tflops), dequant_seconds(bwd, 1, hw.bf16_tflops)))
    return out


def long_sequence_overheads(sizes: ModelSizes, plan: Plan, hw: HardwareSpec, *, batch: int, seq: int,
                            mlp_chunk: int, chunk_call_s: float = CHUNK_CALL_S,
                            tile_merge_s: float = TILE_MERGE_S) -> list[tuple[float, float]]:
    """Per pack, (forward, backward) seconds that long sequences cost beyond their FLOPs: every
    call of a token-chunked module (:data:`CHUNK_CALL_S`; one pass in the forward, three in the
    backward: the recompute, the chunk's own recompute under its checkpoint, its backward; a kept
    pack's backward the last two) and tiled attention's merges (:data:`TILE_MERGE_S`, a third in
    the forward, two in the backward, scaled by the GPU's rate like the other memory-bound work)
    wherever segment attention runs
    (sequences above :data:`~tinypipe.models.chunked_mlp.LONG_SEQUENCE_TOKENS` of its families,
    chunked or not). Zeros for short sequences: they price exactly as before. ``chunk_call_s`` /
    ``tile_merge_s``: other values of the two constants (their refit counts calls and merges with 1)."""
    if seq <= LONG_SEQUENCE_TOKENS and mlp_chunk <= 0:
        return [(0.0, 0.0)] * plan.num_packs
    n_f, n_b, c_f, c_b = _micro_batches_and_chunks(plan, batch, seq, mlp_chunk)
    folded = sizes.model_type in FOLDABLE  # q, k, v and the MLP in chunks; else the MLP alone
    modules = 4 if folded else 1
    calls_f = n_f * (c_f if c_f > 1 else 0) * modules
    calls_b = n_b * (c_b if c_b > 1 else 0) * modules * 3
    calls_kept = calls_f * 2  # a kept pack's backward: the chunk's recompute and its backward only
    merges = 0.0
    segment = sizes.attended_tokens(seq)
    tile = sizes.attention_tile
    if sizes.model_type in SEGMENT_FAMILIES and seq > LONG_SEQUENCE_TOKENS and 0 < tile < segment:
        tiles = -(-segment // tile)
        merges = (tiles - 1) / 2.0 * batch * seq * tile_merge_s * TILE_MERGE_REFERENCE_TFLOPS / max(
            hw.bf16_tflops, 1e-9)
    return [(calls_f * chunk_call_s * len(p) + merges * len(p) / 3.0,
             (calls_kept if plan.kept(q) else calls_b) * chunk_call_s * len(p) + merges * len(p) * 2.0 / 3.0)
            for q, p in enumerate(plan.packs)]


def _micro_batches_and_chunks(plan: Plan, batch: int, seq: int, mlp_chunk: int) -> tuple[int, int, int, int]:
    """Forward and backward micro-batches per step, and the token chunks each runs its chunked
    modules in."""
    return (-(-batch // max(1, plan.micro_batch_size)), -(-batch // max(1, plan.backward_micro_batch_size)),
            _token_chunks(min(plan.micro_batch_size, batch) * seq, mlp_chunk),
            _token_chunks(min(plan.backward_micro_batch_size, batch) * seq, mlp_chunk))


def _token_chunks(tokens: int, mlp_chunk: int) -> int:
    """How many chunks a micro-batch of ``tokens`` runs its chunked weights in (1: unchunked, as
    :class:`~tinypipe.models.chunked_mlp.ChunkedMLP` runs any micro-batch of at most a chunk)."""
    if mlp_chunk <= 0 or tokens <= mlp_chunk:
        return 1
    return -(-tokens // mlp_chunk)


def add_stash_traffic(lanes: Lanes, plan: Plan, stash_bytes: int, long_sequences: bool = False) -> None:
    """Host-stashed pack inputs (:func:`~tinypipe.schedule.plan.host_stashed_inputs`; at long
    sequences the embedding's output too, written down by the embedding's forward): written down
    and read back up in the forward, read up in the backward (unless the pack keeps its
    activations)."""
    P = plan.num_packs
    for q, on_host in enumerate(host_stashed_inputs(plan, long_sequences)):
        if on_host:
            lanes.f_down[plan.embed_device if q == 0 else plan.fwd_device[q - 1]] += stash_bytes
            reader = plan.fwd_device[q] if q < P else plan.head_device
            lanes.f_up[reader] += stash_bytes
            if q < P and not plan.kept(q):  # a kept pack's backward reads no stash
                lanes.b_up[plan.bwd_device[q]] += stash_bytes


def add_host_gradient_traffic(lanes: Lanes, plan: Plan, stash_bytes: int, long_sequences: bool) -> None:
    """Boundary gradients in their host stash's rows (long sequences,
    :func:`~tinypipe.schedule.plan.host_gradient_boundaries`): written down by the pack whose
    input it is, read up by the pack before it (boundary 0: by the embedding's backward), both in
    the backward."""
    for q, on_host in enumerate(host_gradient_boundaries(plan, long_sequences)):
        if on_host:
            lanes.down[plan.bwd_device[q]] += stash_bytes
            lanes.b_up[plan.bwd_device[q - 1] if q > 0 else plan.embed_device] += stash_bytes


def add_host_kept_traffic(lanes: Lanes, plan: Plan, held: Sequence[int]) -> None:
    """Kept graphs in host memory (``Plan.kept_on_host``): pack ``q``'s saved activations
    (``held[q]`` bytes) go down in its forward and come back up in its backward."""
    for q in range(plan.num_packs):
        if plan.on_host(q):
            lanes.f_down[plan.fwd_device[q]] += held[q]
            lanes.b_up[plan.bwd_device[q]] += held[q]


def fill_s(packs: Packs, embed_dev: bool, head_dev: bool, h2d: float) -> float:
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
class OnDevice:
    """Layers stepped on their device (``device_optimizer``, resident packs): no upload, no
    download, no host AdamW."""

    embed: bool
    head: bool
    resident_train: int  # trainable elements of the resident packs
    train: int  # all trainable elements stepped on a device


def on_device(packs: Packs) -> OnDevice:
    plan, trains = packs.plan, packs.sizes.layer_train_numels
    embed = 0 in plan.device_optimized(plan.embed_device)
    head = plan.num_blocks + 1 in plan.device_optimized(plan.head_device)
    resident_train = sum(packs.train[q] for q in range(plan.resident_packs))
    train = (trains[0] if embed else 0) + (trains[-1] if head else 0) + resident_train
    return OnDevice(embed, head, resident_train, train)


def layer_devices(plan: Plan, pack_devices: tuple[int, ...]) -> dict[int, int]:
    """Layer id -> its device: the embedding's and the head's, each block its pack's in
    ``pack_devices`` (the forward's or the backward's placement; empty: one device)."""
    where = {0: plan.embed_device, plan.num_blocks + 1: plan.head_device}
    for q, p in enumerate(plan.packs):
        for b in p:
            where[b + 1] = pack_devices[q] if pack_devices else 0
    return where


def forward_terms(lanes: Lanes, slowdown: float, rates: Rates) -> dict[str, float]:
    """The forward pass's limits: the busiest device's compute, uploads, stash writes, both links."""
    return {"compute": max(lanes.f_comp) * slowdown, "upload": max(lanes.f_up) / rates.h2d,
            "stash download": max(lanes.f_down) / rates.d2h,
            "link (both directions)": max(u + d for u, d in zip(lanes.f_up, lanes.f_down)) / rates.bidir}


def backward_terms(lanes: Lanes, slowdown: float, rates: Rates) -> dict[str, float]:
    """The backward pass's limits on the devices and links (the host AdamW lane beside it is
    :func:`host_lane_arrivals`)."""
    return {
        "compute": max(lanes.b_comp) * slowdown,
        "upload": max(lanes.b_up) / rates.h2d,
        "download": max(lanes.down) / rates.d2h,
        "link (both directions)": max(u + d for u, d in zip(lanes.b_up, lanes.down)) / rates.bidir,
    }


def host_lane_arrivals(packs: Packs, order: BackwardOrder, dev: OnDevice, backward_s: float,
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


def recompute_seconds(sizes: ModelSizes, plan: Plan, hw: HardwareSpec, *, batch: int, seq: int,
                      precision: str = "bf16") -> list[float]:
    """Per pack: the seconds of its backward's recompute (its forward's FLOPs at the backward
    micro-batch's recompute rate) -- what keeping its activations saves."""
    rates = rates_for(hw, precision, seq, tf=min(plan.micro_batch_size, batch) * seq,
                   tb=min(plan.backward_micro_batch_size, batch) * seq)
    attn_per_token = 2.0 * sizes.attended_tokens(seq) * sizes.num_heads * sizes.head_dim
    stats = pack_stats(sizes, plan.packs)
    return [(2.0 * st[2] + attn_per_token * len(p)) * batch * seq / rates.recompute
            for st, p in zip(stats, plan.packs)]
