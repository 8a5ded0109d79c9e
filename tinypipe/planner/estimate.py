"""Memory of a plan without running it: the engine's static categories byte for byte, plus a
calibrated estimate of each device's activation peak.

Static parts mirror :class:`tinypipe.Engine` exactly (same categories, same byte counts as
``Engine.memory_report()`` after a step):

host
    ``master_weights`` 4 B and ``optimizer_state`` 8 B per flat element; ``pinned_grad_pool`` one
    pool per device entry of ``buffer_count(...)`` fp32 chunks of ``chunk_numel(slot)`` elements;
    ``gradient_buffers`` 4 B per flat element when gradients are retained (``max_grad_norm`` set
    or the non-finite policy ``"skip"``), else 4 B per element of the deferred layers
    (``Plan.deferred``); ``stashed_activations`` one ``[B, S, H]`` buffer in the compute dtype per
    host-stashed pack input (at long sequences the embedding's output too:
    :func:`~tinypipe.schedule.plan.host_stashed_inputs`) but those on the SSD (``Plan.stash_on_ssd``),
    which ``ssd_stash_staging`` replaces by a staging pool (:mod:`tinypipe.storage.stash_layout`).
    With ``plan.offload`` each offloaded region's bytes
    leave its category and ``ssd_staging`` holds the staging pool (:mod:`tinypipe.planner.offload`).
device
    ``resident_layers`` embedding / head in the compute dtype where they live; ``layer_slots``
    (largest pack + window) slots of the largest block; ``gradient_accumulators`` (largest pack + 1)
    fp32 slots plus fp32 resident gradients; ``staging`` an fp32 buffer of min(slot, 32 Mi)
    elements on CUDA in bf16 mode; ``assist_scratch`` on every device of a plan that assists
    updates (``Plan.assisted``), the chunk buffers of
    :func:`~tinypipe.memory.device_pool.assist_scratch_numel` (192 MiB).

``activations_peak`` (per device; everything the engine allocates on top of the static pools)
is the maximum over the phases of one step -- embedding forward, each pack's forward, the head,
each pack's backward, the embedding backward, the embedding's gradient download -- of

* the ``[B, S, H]`` boundary buffers alive on that device in that phase (pack inputs stashed on
  the device, and the gradient buffers between packs: allocated by the consumer pack, freed
  after its backward);
* the phase's own working set: a backward keeps what autograd saves for every block of the pack
  (``ModelSizes.block_act_bytes`` per token, measured on a probe model) for one backward
  micro-batch (a pack that keeps its activations, ``Plan.keep_activations``, recomputes nothing:
  its backward's working set is one forward micro-batch's gradient transient);
* a kept pack's graphs (:func:`kept_bytes`: the same saved bytes per token and block, for every
  token of the step, plus the pack's outputs), alive on its device from its forward to its
  backward -- in a micro-batch-wise turn (``Plan.turn_packs``) one forward micro-batch's, and
  whatever is alive in one of the turn's phases (its packs' forwards, the head, their backwards,
  which interleave) counted in all of them; the head keeps one token chunk of logits (its
  gradient written over them) and an fp32 row block of it; the embedding backward a dense
  weight gradient and the CUDA kernel's fp32 partial sums;
* the transient of a gradient download: the runtime computes each layer's gradient norm with
  ``vector_norm(..., dtype=float64)``, which materialises an fp64 copy of the layer's fp32
  gradient (:data:`NORM_COPY_BYTES_PER_ELEMENT`). It is counted where it was measured to add to
  the peak: beside the embedding backward (pack 0's downloads) and for the embedding's own
  download at the end of the step. Beside a pack's backward it is short compared with the
  backward's own peak and was not seen to coincide with it (Llama-2-7B shape, pack 4: 9.38 GB
  measured, 9.40 GB estimated without it, 11.0 GB with it);
* per CUDA device, the two host-stash prefetch buffers and a constant for library workspaces
  (cuBLAS) and small tensors (:data:`CUDA_WORKSPACE_BYTES`).

Calibrated on an H200 (bf16, 16 x 2048 tokens; see tests/test_planner.py): Llama-3.2-3B shape
pack 2 / micro-batch 4 / host stash 3.56 GB measured, micro-batch 2 3.47 GB; Llama-2-7B shape
pack 4 / micro-batch 4 / device stash 9.38 GB, pack 1 / micro-batch 2 / host stash 3.54 GB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tinypipe.errors import ConfigError
from tinypipe.memory.device_pool import assist_scratch_numel
from tinypipe.memory.grad_pool import buffer_count, chunk_numel
from tinypipe.memory.report import CPU_DEVICE_POOLS, MemoryReport
from tinypipe.models.head_loss import logit_bytes
from tinypipe.models.segment_attention import FAMILIES, segment_attention_for
from tinypipe.models.tiled_attention import ATTENTION_TILE_OPTIONS, tiled_backward_bytes_per_token
from tinypipe.planner.offload import apply_offload
from tinypipe.planner.kept import kept_bytes
from tinypipe.planner.sizes import ModelSizes, dtype_bytes
from tinypipe.planner.work import pack_stats
from tinypipe.schedule.plan import Plan, host_gradient_boundaries, host_stashed_inputs
from tinypipe.schedule.stash_places import host_memory_stashes
from tinypipe.schedule.transient_grads import transient_grad_layers, transient_weight_layers
from tinypipe.storage import stash_layout

#: Elements of the fp32 upload staging buffer (``tinypipe.runtime.engine.STAGING_MAX``).
STAGING_MAX = 32 * 1024 * 1024
#: Bytes per gradient element of a transient copy made while a layer's gradients are downloaded.
#: The runtime used ``vector_norm(acc, dtype=float64)`` (an fp64 copy: 8 B/element) until
#: 2026-11-30; it now reduces fp32 chunks in place (0). The H200 calibration points predate the fix.
NORM_COPY_BYTES_PER_ELEMENT = 0
#: cuBLAS workspaces per stream, loss scalars, contexts: measured residue on the H200 runs.
CUDA_WORKSPACE_BYTES = 288 * 1024**2
#: Rows of the query heads' width (``heads * head_dim``, compute dtype) per token that a block's
#: attention backward allocates beside its saved tensors: the output gradient and the kernel's
#: copy of it, dQ, dQ's fp32 accumulator (two rows' bytes), and dK, dV at the query heads' width
#: (grouped-query attention expands them before summing each group). What sets the peak of a
#: chunked block's backward, whose MLP holds one chunk's rows; an unchunked MLP's saved
#: intermediates always outweigh it. The H100's allocator history at 2 x 64K tokens (QLoRA, the
#: Llama-3.1-8B shape, bench/results/acceptance/e8bdd13/) shows 6.5 such rows with compiled
#: blocks and 7.5 with eager ones (tests/test_long_context_planner.py).
ATTENTION_BACKWARD_ROWS = 7

def _is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def attention_tile_of(sizes: ModelSizes, seq: int) -> int:
    """The attention tile a run of ``seq``-token rows uses (0: whole segments): where segment
    attention is on by default (models/segment_attention.py) and a row is longer than a tile."""
    tile = sizes.attention_tile
    return tile if _tiles_run(sizes.model_type, seq) and 0 < tile < seq else 0


def _tiles_run(model_type: str, seq: int) -> bool:
    """Whether ``seq``-token rows of ``model_type`` attend per segment by default: where tiles
    run."""
    return segment_attention_for(None, seq) and model_type in FAMILIES


def attention_tile_options(model_type: str, seq: int) -> tuple[int, ...]:
    """The attention tiles worth weighing for ``seq``-token rows of ``model_type``: those of
    :data:`~tinypipe.models.tiled_attention.ATTENTION_TILE_OPTIONS` shorter than a row where
    segment attention runs by default; () where it does not (the tile changes nothing there)."""
    if not _tiles_run(model_type, seq):
        return ()
    return tuple(t for t in ATTENTION_TILE_OPTIONS if t < seq)


def attention_backward_bytes(sizes: ModelSizes, tokens: int, seq: int, elem: int) -> int:
    """What one block's attention backward allocates for ``tokens`` tokens of ``seq``-token rows
    beside the block's saved tensors: :data:`ATTENTION_BACKWARD_ROWS` rows of the query width per
    token for the whole-segment kernel, the tiled backward's count
    (:func:`~tinypipe.models.tiled_attention.tiled_backward_bytes_per_token`) in tiles."""
    q_width = sizes.num_heads * sizes.head_dim
    tile = attention_tile_of(sizes, seq)
    if not tile:
        return tokens * ATTENTION_BACKWARD_ROWS * q_width * elem
    kv_width = sizes.num_kv_heads * sizes.head_dim
    return int(tokens * tiled_backward_bytes_per_token(q_width, kv_width, elem, seq, tile))


def head_chunk_tokens(vocab: int, budget_bytes: int = 512 * 1024**2) -> int:
    """Tokens per head chunk (``tinypipe.models.head.chunk_tokens_for``)."""
    from tinypipe.models.head import chunk_tokens_for

    return chunk_tokens_for(vocab, budget_bytes)


def host_bytes(sizes: ModelSizes, plan: Plan, *, batch: int, seq: int, precision: str, num_devices: int,
               host_grad_buffers: int | None = None, retain_grads: bool = False,
               hidden: int | None = None, mlp_chunk: int = 0) -> dict[str, int]:
    """Host memory by category (``Engine.memory_report().host`` after a step; ``mlp_chunk`` > 0:
    long sequences, the embedding's output may be host-stashed too)."""
    hidden = hidden or sizes.hidden
    train = sizes.train_total  # every element, except under LoRA (the adapters only)
    grad = max(1, sizes.grad_slot_numel)
    chunk = chunk_numel(grad)
    stashed = sum(host_memory_stashes(plan, mlp_chunk > 0))  # those on the SSD: a staging pool (below)
    cats = {
        "master_weights": 4 * train,
        "optimizer_state": 8 * train,
        # retained gradients are downloaded straight into their (pinned) buffers: no pool then
        "pinned_grad_pool": 0 if retain_grads else (
            num_devices * buffer_count(grad, host_grad_buffers) * chunk * 4),
        # gradients retained for exact clipping: every layer stepped on the host
        # (without: the deferred layers', Plan.deferred, kept for their update in the next forward)
        "gradient_buffers": 4 * (train - device_stepped_numel(sizes, plan)) if retain_grads else (
            4 * sum(sizes.layer_train_numels[layer] for layer in plan.deferred)),
        "stashed_activations": stashed * batch * seq * hidden * dtype_bytes(precision),
    }
    if plan.stash_on_ssd:  # pack inputs in the offload directory's files (runtime/ssd_stash.py)
        cats[stash_layout.STASH_STAGING_CATEGORY] = stash_layout.staging_bytes(
            len(plan.stash_on_ssd), batch=batch, seq=seq, hidden=hidden, itemsize=dtype_bytes(precision),
            micro_batch_size=plan.micro_batch_size, backward_micro_batch_size=plan.backward_micro_batch_size)
    on_host = [q for q in range(plan.num_packs) if plan.on_host(q)]
    if on_host:  # kept graphs waiting in host memory (runtime/host_kept.py)
        cats["kept_activations"] = sum(kept_bytes(sizes, plan, q, batch=batch, seq=seq, precision=precision,
                                                  hidden=hidden) for q in on_host)
    if sizes.frozen_total:  # LoRA: the frozen base at compute precision (QLoRA: its payload bytes)
        cats[sizes.frozen_label] = sizes.frozen_total * dtype_bytes(precision)
    return apply_offload(cats, sizes, plan, precision)  # state on the SSD leaves DRAM; staging comes


def device_stepped_numel(sizes: ModelSizes, plan: Plan, index: int | None = None) -> int:
    """Trainable elements whose AdamW runs on device ``index`` (all devices: None)."""
    trains = sizes.layer_train_numels  # runtime layer order: embedding, blocks, head
    devices = range(plan.num_devices) if index is None else [index]
    return sum(trains[layer] for d in devices for layer in plan.device_optimized(d))


def transient_weights(sizes: ModelSizes, plan: Plan, long_sequences: bool) -> frozenset[int]:
    """The frozen embedding / head whose weight buffer lives only while read (schedule/
    transient_grads.py ``transient_weight_layers``)."""
    trains = sizes.layer_train_numels
    frozen = frozenset(layer for layer in (0, plan.num_blocks + 1) if not trains[layer])
    return transient_weight_layers(plan, sizes.tied, frozen, long_sequences)


def device_static_bytes(sizes: ModelSizes, plan: Plan, index: int, device: str,
                        precision: str, long_sequences: bool = False) -> dict[str, int]:
    """Preallocated bytes of device entry ``index`` (``DevicePool.bytes_by_category``; at long
    sequences without the transient accumulators and weights, which :func:`activation_peaks`
    counts)."""
    transient = transient_grad_layers(plan, sizes.tied, long_sequences)
    lent = transient_weights(sizes, plan, long_sequences)
    a = dtype_bytes(precision)
    slot = sizes.slot_numel
    has_packs = index in plan.fwd_device or index in plan.bwd_device
    trains = sizes.layer_train_numels
    resident = resident_grad = 0
    if index == plan.embed_device:
        resident += 0 if 0 in lent else sizes.embed_numel
        resident_grad += 0 if 0 in transient else trains[0]
    if index == plan.head_device:
        resident += 0 if plan.num_blocks + 1 in lent else sizes.head_numel
        resident_grad += 0 if plan.num_blocks + 1 in transient else trains[-1]
    for layer in plan.resident_layers(index):  # resident packs: own buffers, never swapped
        resident += sizes.block_numels[layer - 1]
        resident_grad += trains[layer]
    slots = plan.param_slots() if has_packs else 0
    gslots = plan.grad_slot_count() if has_packs else 0
    staging = min(slot, STAGING_MAX) * 4 if (_is_cuda(device) and precision != "fp32") else 0
    cats = {
        "resident_layers": resident * a,
        "layer_slots": slots * slot * a,
        "gradient_accumulators": gslots * sizes.grad_slot_numel * 4 + resident_grad * 4,
        "staging": staging,
    }
    if plan.assisted:  # every device holds the chunk buffers of assisted updates
        cats["assist_scratch"] = 4 * assist_scratch_numel(True)
    if plan.device_optimized(index):  # fp32 master + two AdamW moments of the layers stepped here
        cats["optimizer_state"] = 12 * device_stepped_numel(sizes, plan, index)
    return cats


def activation_peaks(sizes: ModelSizes, plan: Plan, *, batch: int, seq: int, precision: str,
                     devices: Sequence[str], hidden: int | None = None, vocab: int | None = None,
                     head_chunk: int | None = None, detail: bool = False,
                     act_per_token: float | None = None,
                     mlp_chunk: int = 0) -> list[int] | tuple[list[int], list[str]]:
    """Estimated activation peak per device entry (bytes), and with ``detail`` the phase that
    sets it. ``act_per_token`` overrides the probe's saved bytes per token and block (a measured
    profile's value). ``mlp_chunk``: the blocks' MLPs run in chunks of that many tokens
    (``Config.mlp_chunk_tokens``, 0: unchunked) -- a micro-batch of more tokens holds one chunk's
    MLP intermediates in its forward, and its backward saves every token's block activations but
    the MLP's (:meth:`~tinypipe.planner.sizes.ModelSizes.chunked_block_bytes`) plus one chunk's
    recomputed ones. See the module documentation for the model."""
    ledger = _account(_Ledger(len(devices), 2 * plan.num_packs + 4, labelled=False), sizes, plan, batch=batch,
                      seq=seq, precision=precision, devices=devices, hidden=hidden, vocab=vocab,
                      head_chunk=head_chunk, act_per_token=act_per_token, mlp_chunk=mlp_chunk)
    peaks, where = [], []
    for d in range(len(devices)):
        k, total = ledger.peak(d)
        peaks.append(total)
        where.append(_phase_name(k, plan.num_packs))
    return (peaks, where) if detail else peaks


@dataclass(frozen=True)
class PeakBreakdown:
    """What one device's estimated activation peak is made of: the phase that sets it and the
    bytes of each kind of tensor alive then (``parts``, largest first; they add up to the peak)."""

    phase: str
    parts: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(b for _, b in self.parts)


def activation_breakdown(sizes: ModelSizes, plan: Plan, *, batch: int, seq: int, precision: str,
                         devices: Sequence[str], hidden: int | None = None, vocab: int | None = None,
                         head_chunk: int | None = None, act_per_token: float | None = None,
                         mlp_chunk: int = 0) -> list[PeakBreakdown]:
    """Per device entry, :func:`activation_peaks`' peak taken apart: which tensors the estimate
    holds alive in the phase that sets it. Why: a plan that does not fit, or a GPU peak above the
    estimate, is acted on by knowing which term dominates (the saved activations, the attention
    backward, the stash's read-ahead, ...), not only the total."""
    ledger = _account(_Ledger(len(devices), 2 * plan.num_packs + 4, labelled=True), sizes, plan, batch=batch,
                      seq=seq, precision=precision, devices=devices, hidden=hidden, vocab=vocab,
                      head_chunk=head_chunk, act_per_token=act_per_token, mlp_chunk=mlp_chunk)
    out = []
    for d in range(len(devices)):
        k, _ = ledger.peak(d)
        out.append(PeakBreakdown(_phase_name(k, plan.num_packs), ledger.parts(d, k)))
    return out


class _Ledger:
    """Bytes per device entry and phase of one step: ``work`` a phase's own working set, ``span``
    what lives across phases (a difference array), ``const`` what a device holds in every phase.
    ``labelled``: also keep what each byte is, for :func:`activation_breakdown` (the search's many
    estimates skip that)."""

    def __init__(self, devices: int, phases: int, labelled: bool) -> None:
        self.delta = [[0] * (phases + 1) for _ in range(devices)]
        self.load = [[0] * phases for _ in range(devices)]
        self.fixed = [0] * devices
        self.labelled = labelled
        self._work: list[list[list[tuple[str, int]]]] = [[[] for _ in range(phases)] for _ in range(devices)]
        self._spans: list[list[tuple[int, int, str, int]]] = [[] for _ in range(devices)]
        self._fixed: list[list[tuple[str, int]]] = [[] for _ in range(devices)]

    def work(self, dev: int, phase: int, *parts: tuple[str, int | float]) -> None:
        """``parts``: (label, bytes) entered as one sum (the float sums of the saved activations
        then round as they always have)."""
        self.load[dev][phase] += sum(b for _, b in parts)  # type: ignore[assignment]
        if self.labelled:
            self._work[dev][phase] += [(label, int(b)) for label, b in parts if b]

    def span(self, dev: int, lo: int, hi: int, nbytes: int, label: str) -> None:
        self.delta[dev][lo] += nbytes
        self.delta[dev][hi + 1] -= nbytes
        if self.labelled and nbytes:
            self._spans[dev].append((lo, hi, label, nbytes))

    def const(self, dev: int, nbytes: int, label: str) -> None:
        self.fixed[dev] += nbytes
        if self.labelled and nbytes:
            self._fixed[dev].append((label, nbytes))

    def peak(self, dev: int) -> tuple[int, int]:
        """(phase, bytes) of ``dev``'s fullest phase (the first of equals)."""
        totals, run = [], 0
        for k, load in enumerate(self.load[dev]):
            run += self.delta[dev][k]
            totals.append(run + load)
        k = max(range(len(totals)), key=totals.__getitem__)
        return k, int(totals[k] + self.fixed[dev])

    def parts(self, dev: int, phase: int) -> tuple[tuple[str, int], ...]:
        merged: dict[str, int] = {}
        alive = [(label, b) for lo, hi, label, b in self._spans[dev] if lo <= phase <= hi]
        for label, b in alive + self._work[dev][phase] + self._fixed[dev]:
            merged[label] = merged.get(label, 0) + b
        return tuple(sorted(merged.items(), key=lambda t: -t[1]))


def _account(ledger: _Ledger, sizes: ModelSizes, plan: Plan, *, batch: int, seq: int, precision: str,
             devices: Sequence[str], hidden: int | None, vocab: int | None, head_chunk: int | None,
             act_per_token: float | None, mlp_chunk: int) -> _Ledger:
    """``ledger`` with everything :func:`activation_peaks` counts entered (the model: the module
    documentation)."""
    H = hidden or sizes.hidden
    V = vocab or sizes.vocab
    a = dtype_bytes(precision)
    P = plan.num_packs
    B, S = batch, seq
    tf = min(plan.micro_batch_size, B) * S  # tokens per forward / backward micro-batch
    tb = min(plan.backward_micro_batch_size, B) * S
    bsh = B * S * H * a
    chunk = head_chunk or head_chunk_tokens(V)
    act_tok = act_per_token or sizes.block_act_bytes(precision)
    kept_tok = min(act_tok, sizes.kept_block_bytes(precision))
    cuda = [_is_cuda(d) for d in devices]
    norm_copy = NORM_COPY_BYTES_PER_ELEMENT

    # ---- phases in global order: EF, F0..F(P-1), HEAD, B(P-1)..B0, EB, DLE ----------------
    EF, HEAD, EB, DLE = 0, P + 1, 2 * P + 2, 2 * P + 3

    def F(q: int) -> int:
        return 1 + q

    def Bk(q: int) -> int:
        return P + 2 + (P - 1 - q)

    nphase = 2 * P + 4
    work = ledger.work

    # the micro-batch-wise turn (Plan.turn_packs) interleaves its packs' forward, head and backward
    # phases, once per forward micro-batch: whatever is alive in one of them is alive in all
    turn_lo, turn_hi = (F(P - plan.turn_packs), Bk(P - plan.turn_packs)) if plan.turn_packs else (nphase, -1)

    def alive(dev: int, lo: int, hi: int, nbytes: int, label: str) -> None:
        if lo <= turn_hi and hi >= turn_lo:
            lo, hi = min(lo, turn_lo), max(hi, turn_hi)
        ledger.span(dev, lo, hi, nbytes, label)

    # activation buffers: acts[q] is the input of pack q (q == P: the head's); in host memory where
    # host_stashed_inputs says so (at long sequences the embedding's output too)
    stashed = host_stashed_inputs(plan, mlp_chunk > 0)
    for q in range(P + 1):
        if stashed[q]:
            continue
        owner = plan.embed_device if q == 0 else (plan.fwd_device[q] if q < P else plan.head_device)
        if q == 0:
            alive(owner, EF, EB, bsh, "pack inputs kept on the device")
        elif q < P:
            alive(owner, F(q - 1), Bk(q), bsh, "pack inputs kept on the device")
        else:
            alive(owner, F(P - 1), HEAD, bsh, "pack inputs kept on the device")
    # gradient buffers: grads[q] is d loss / d (input of pack q), written by pack q's backward;
    # at long sequences a host-stashed boundary's lives in its stash's rows (host_gradient_boundaries):
    # the reading backward holds one micro-batch's rows of it instead (boundary 0's reader, the
    # embedding's backward, is counted with it below)
    host_grads = host_gradient_boundaries(plan, mlp_chunk > 0)
    for q in range(P + 1):
        if host_grads[q]:
            if q > 0:
                work(plan.bwd_device[q - 1], Bk(q - 1), ("boundary gradient rows", tb * H * a))
            continue
        owner = plan.embed_device if q == 0 else plan.bwd_device[q - 1]
        start = HEAD if q == P else Bk(q)
        end = EB if q == 0 else Bk(q - 1)
        alive(owner, start, end, bsh, "boundary gradients")

    def remote_rows(q: int, dev: int, tokens: int) -> int:
        """A micro-batch's input rows copied onto ``dev`` when the pack input lives elsewhere."""
        owner = plan.embed_device if q == 0 else (plan.fwd_device[q] if q < P else plan.head_device)
        return tokens * H * a if (stashed[q] or owner != dev) else 0

    e, h = plan.embed_device, plan.head_device
    # embedding forward: the trunk's own temporaries beside its output (acts[0], counted above; in
    # host memory, the output is on the device until its micro-batches are copied down)
    work(e, EF, ("embedding forward (whole batch)", bsh * (2 if stashed[0] else 1)))

    def mlp_rows(tokens: int) -> int:
        """Tokens whose MLP intermediates exist at once: a chunk's, when the MLP is chunked."""
        return min(tokens, mlp_chunk) if mlp_chunk > 0 else tokens

    # forward packs (no autograd): one block's largest temporaries for one micro-batch
    for q in range(P):
        d = plan.fwd_device[q]
        temporaries = (mlp_rows(tf) * 3 * sizes.intermediate + tf * 4 * H) * a
        work(d, F(q), ("a block's forward temporaries", temporaries),
             ("input rows copied in", remote_rows(q, d, tf)))
    # head: input-gradient rows, one chunk of logits (compute dtype, the gradient written over them)
    # and the eager path's fp32 row block (models/head_loss.py)
    work(h, HEAD, ("head input gradient", tf * H * a),
         ("head logit chunk", logit_bytes(chunk, V, a) + chunk * H * 4),
         ("input rows copied in", remote_rows(P, h, tf)))
    # transient gradient accumulators (schedule/transient_grads.py): alive in their phase only --
    # the head's until its download, which the first backward waits for; the embedding's until its
    # own download
    transient = transient_grad_layers(plan, sizes.tied, mlp_chunk > 0)
    trains = sizes.layer_train_numels
    if plan.num_blocks + 1 in transient:
        work(h, HEAD, ("transient gradient accumulator", 4 * trains[-1]))
    if 0 in transient:
        work(e, EB, ("transient gradient accumulator", 4 * trains[0]))
        work(e, DLE, ("transient gradient accumulator", 4 * trains[0]))
    # transient frozen weights: the embedding's for its forward, the head's from its upload (queued
    # behind the first pack's, so possibly during the embedding's forward) through the head tasks
    lent = transient_weights(sizes, plan, mlp_chunk > 0)
    if 0 in lent:
        work(e, EF, ("transient frozen weights", sizes.embed_numel * a))
    if plan.num_blocks + 1 in lent:
        alive(h, EF, HEAD, sizes.head_numel * a, "transient frozen weights")
    # backward packs: saved activations of the whole pack for one micro-batch, the backward's
    # own transient (one block's intermediate gradients), the downloads running beside it
    for q in range(P):
        d = plan.bwd_device[q]
        pack = plan.packs[q]
        if plan.kept(q):  # no recompute: one forward micro-batch's graph differentiated at a time
            # (a compact graph recomputes one block's elementwise tensors for it: the difference)
            work(d, Bk(q), ("kept pack's backward transient",
                            tf * 2 * sizes.intermediate * a + tf * max(0.0, act_tok - kept_tok)))
            continue
        mlp_tok = act_tok * sizes.mlp_bytes_per_token(precision) / sizes.block_act_bytes(precision)
        if mlp_rows(tb) < tb:  # chunked: no MLP intermediates saved, one chunk's recomputed at a time
            saved = (tb * (act_tok - mlp_tok) * len(pack) + mlp_rows(tb) * mlp_tok
                     + tb * H * a * (len(pack) - 1))
        else:
            saved = tb * act_tok * len(pack) + tb * H * a * (len(pack) - 1)
        # a block's backward runs its MLP's (one chunk's when chunked: its recomputed intermediates
        # and their gradients), then its attention's, once the MLP's saved tensors are freed
        mlp_phase = mlp_rows(tb) * 2 * sizes.intermediate * a
        attention_phase = attention_backward_bytes(sizes, tb, S, a) - mlp_rows(tb) * mlp_tok
        larger = ("attention backward temporaries" if attention_phase > mlp_phase
                  else "MLP backward intermediates")
        work(d, Bk(q), ("the pack's recomputed saved activations", saved),
             (larger, max(mlp_phase, attention_phase)),
             ("input rows copied in", remote_rows(q, d, tb)))
    # kept packs: every forward micro-batch's graph, from the pack's forward to its backward; in
    # host memory (Plan.kept_on_host) only what is in flight: two forward micro-batches' graphs
    # on their way down (until the forward ends: the link may lag), the backward's and the next
    # one's copied back (runtime/host_kept.py)
    nf = -(-B // min(plan.micro_batch_size, B))
    turn = set(plan.turn())
    for q in range(P):
        if plan.kept(q):
            # a turn pack holds one forward micro-batch's graph at a time
            rows = min(plan.micro_batch_size, B) if q in turn else B
            held = kept_bytes(sizes, plan, q, batch=rows, seq=S, precision=precision, hidden=H,
                              act_per_token=kept_tok)
            if plan.on_host(q):
                one = -(-held // nf)
                # the link may still be carrying them down while the later packs run forward
                alive(plan.fwd_device[q], F(q), F(P - 1), 2 * one, "kept graphs in flight to the host")
                work(plan.bwd_device[q], Bk(q), ("kept graphs in flight to the host", 2 * one))
                before = HEAD if q == P - 1 else Bk(q + 1)  # its first graph comes back meanwhile
                work(plan.bwd_device[q], before, ("kept graphs in flight to the host", one))
                continue
            alive(plan.fwd_device[q], F(q), Bk(q), held, "kept pack graphs")
    # embedding backward: recomputed output, dense weight gradient, CUDA fp32 partial sums, and
    # the downloads of pack 0's layers beside it -- with its input gradient in host memory one
    # forward micro-batch at a time (its rows and its recomputed output), unless dropout may draw
    # in the embedding's forward (the runtime then replays the whole batch: its gradient copied up)
    by_rows = host_grads[0] and not sizes.draws
    rows = tf if by_rows else B * S
    partials = min(rows, V) * H * 4 if cuda[e] else 0
    beside0 = pack_stats(sizes, plan.packs)[0][1] if plan.bwd_device[0] == e else 0
    gout = rows * H * a if host_grads[0] else 0
    work(e, EB, ("embedding backward", rows * H * a + gout + sizes.embed_numel * a + partials),
         ("gradient norm copies", norm_copy * beside0))
    # the embedding's own gradient download (after everything else)
    work(e, DLE, ("gradient norm copies", norm_copy * sizes.embed_numel))

    for d in range(len(devices)):
        if cuda[d]:
            reads_host = any(stashed[q] and (plan.fwd_device[q] == d or plan.bwd_device[q] == d)
                             for q in range(P)) or (by_rows and d == e)
            if reads_host and (B > plan.micro_batch_size or B > plan.backward_micro_batch_size):
                ledger.const(d, 2 * max(tf, tb) * H * a, "host-stash read-ahead buffers")
            ledger.const(d, CUDA_WORKSPACE_BYTES, "CUDA workspaces")
    return ledger


def _phase_name(k: int, P: int) -> str:
    if k == 0:
        return "embedding forward"
    if k <= P:
        return f"forward pack {k - 1}"
    if k == P + 1:
        return "head"
    if k <= 2 * P + 1:
        return f"backward pack {P - 1 - (k - P - 2)}"
    return "embedding backward" if k == 2 * P + 2 else "embedding gradient download"


def estimate_memory(sizes: ModelSizes, plan: Plan, *, batch: int, seq: int, precision: str,
                    devices: Sequence[str], hidden: int | None = None, vocab: int | None = None,
                    host_grad_buffers: int | None = None, max_grad_norm: float | None = None,
                    retain_grads: bool | None = None, head_chunk: int | None = None,
                    peaks: Sequence[int] | None = None, act_per_token: float | None = None,
                    mlp_chunk: int = 0) -> MemoryReport:
    """The :class:`MemoryReport` the engine would give for ``plan`` after one step of
    ``batch`` x ``seq`` tokens: static categories exact, ``activations_peak`` estimated.

    ``retain_grads`` defaults to ``max_grad_norm is not None`` (pass True for the engine's
    ``nonfinite="skip"`` policy, which retains gradients too). ``peaks`` reuses activation
    peaks computed for a plan that differs only in window or slot counts.
    """
    devices = list(devices)
    if plan.num_devices != len(devices):
        raise ConfigError(f"plan is for {plan.num_devices} devices, got {len(devices)} device names")
    if plan.num_blocks != sizes.num_blocks:
        raise ConfigError(f"plan covers {plan.num_blocks} blocks, the model has {sizes.num_blocks}")
    retain = (max_grad_norm is not None) if retain_grads is None else retain_grads
    host = host_bytes(sizes, plan, batch=batch, seq=seq, precision=precision, num_devices=len(devices),
                      host_grad_buffers=host_grad_buffers, retain_grads=retain, hidden=hidden,
                      mlp_chunk=mlp_chunk)
    if peaks is None:
        peaks = activation_peaks(sizes, plan, batch=batch, seq=seq, precision=precision, devices=devices,
                                 hidden=hidden, vocab=vocab, head_chunk=head_chunk,
                                 act_per_token=act_per_token, mlp_chunk=mlp_chunk)
    devs = {}
    for i, d in enumerate(devices):
        cats = device_static_bytes(sizes, plan, i, d, precision, long_sequences=mlp_chunk > 0)
        cats["activations_peak"] = peaks[i]
        devs[f"{i}:{d}"] = cats
    on_cpu = cpu_pool_bytes(sizes, plan, devices, precision, long_sequences=mlp_chunk > 0)
    if on_cpu:  # a CPU device's pools are host memory: the host budget must hold them
        host[CPU_DEVICE_POOLS] = on_cpu
    return MemoryReport(host, devs)


def cpu_pool_bytes(sizes: ModelSizes, plan: Plan, devices: Sequence[str], precision: str,
                   long_sequences: bool = False) -> int:
    """The preallocated pools of the CPU entries among ``devices``: host memory."""
    return sum(sum(device_static_bytes(sizes, plan, i, d, precision, long_sequences).values())
               for i, d in enumerate(devices) if not _is_cuda(d))


def store_and_beside(report: MemoryReport) -> tuple[dict[str, int], int]:
    """(the host categories the offload choice works on, the host bytes beside them that no
    offload moves: CPU entries' pools and activations) of an estimate."""
    cats = dict(report.host)
    pools = cats.pop(CPU_DEVICE_POOLS, 0)
    return cats, pools + cpu_activation_bytes(report)


def cpu_activation_bytes(report: MemoryReport) -> int:
    """The activation peaks of a report's CPU device entries: host memory a step takes beyond the
    host categories (the planner's host need adds them)."""
    return sum(cats.get("activations_peak", 0) for name, cats in report.devices.items()
               if not _is_cuda(name.split(":", 1)[1]))


def device_need(report: MemoryReport, name: str) -> int:
    """Static bytes plus the activation peak of one device of an estimate."""
    return report.device_total(name) + report.devices[name].get("activations_peak", 0)
