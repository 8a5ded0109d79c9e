"""Plan search: every combination of the options (:mod:`tinypipe.planner.options`: packings,
micro-batch sizes, prefetch windows, stash placements, embedding/head on the GPU), then resident
packs on the fastest, then kept activations (no recompute) on the fastest, growing their resident
packs (kept too) while they fit;
estimate each plan's memory and step time (:mod:`tinypipe.planner.candidate`
says when a plan fits), keep those that fit, return the fastest and the time-memory Pareto front
(printed by :mod:`tinypipe.planner.format`).

Under clipping every plan is ranked by its clipped step with the layers whose clipped updates its
GPU should step on their way up (``Plan.assisted``, :mod:`tinypipe.planner.assist`), where it can
hold their scratch. Choosing them about doubles the search's time and pays: the clipped step is
predicted about a tenth shorter (docs/measured.md). Without clipping each plan's step
includes the layers stepped right after their backward where the host AdamW would hold it up
(:func:`~tinypipe.planner.cost.predict_step_time`; none on the H200 preset).

With an SSD (``ssd``: an offload directory and its rates, :mod:`tinypipe.planner.ssd`) a plan that
fits the GPUs but not the host moves state to the SSD until it does (:mod:`tinypipe.planner.spill`);
its step time then includes the SSD lanes, so plans that need less on the SSD win where that is
faster. The result also says from which global batch the chosen plan hides the SSD's I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import transformers

from tinypipe.config import Precision
from tinypipe.errors import ConfigError, PlanDoesNotFitError
from tinypipe.models.chunked_mlp import mlp_chunk_tokens_for
from tinypipe.planner.estimate import PeakBreakdown, attention_tile_of, attention_tile_options
from tinypipe.planner.candidate import (  # noqa: F401 - re-exported: the search's public names
    FRAGMENTATION,
    GPU_CONTEXT_BYTES,
    HOST_BASELINE_BYTES,
    Candidate,
    evaluate,
    peak_breakdown,
)
from tinypipe.planner.kept import kept_bytes
from tinypipe.planner.grow import (
    KEEP_SEEDS,
    RESIDENT_SEEDS,
    TURN_SEEDS,
    keep_all,
    with_kept_activations,
    with_resident_packs,
    with_turn,
)
from tinypipe.planner.hardware import HardwareSpec, load_hardware
from tinypipe.planner.offload import disk_bytes, staging_shape, summary
from tinypipe.planner.options import (
    WINDOWS,
    device_optimizer_options,
    micro_batch_options,
    pack_options,
    stash_options,
    useful_micro_batches,
)
from tinypipe.planner.request import PlanRequest
from tinypipe.planner.sharded_host import sharded_candidate
from tinypipe.planner.sizes import ModelSizes, dtype_bytes, lora_sizes, model_sizes
from tinypipe.planner.spill import IoHiding, Spill, hiding_batch, replanned_hiding
from tinypipe.planner.ssd import SsdSpec
from tinypipe.planner.work import REFERENCE_TOKENS, recompute_seconds
from tinypipe.schedule.plan import DeviceOptimizer, Plan, make_plan
from tinypipe.units import gib_pair, gib_text

if TYPE_CHECKING:
    from tinypipe.lora.settings import LoraSettings

#: Plans within this fraction of the fastest count as equally fast; the leanest of them is chosen.
NEAR_FASTEST = 0.01


@dataclass
class PlanResult:
    """The search's answer: the fastest fitting plan and the time-memory Pareto front."""

    best: Candidate
    pareto: list[Candidate]
    sizes: ModelSizes
    hardware: HardwareSpec
    gpus: int
    gpu_memory_bytes: int
    cpu_memory_bytes: int
    seq: int
    global_batch: int
    precision: Precision
    max_grad_norm: float | None
    considered: int
    fitting: int
    model_name: str = ""
    notes: list[str] = field(default_factory=list)
    ssd: SsdSpec | None = None  # the SSD planned for (None: DRAM only)
    hiding: IoHiding | None = None  # where the best plan's SSD I/O is hidden (None: it moves none)
    mlp_chunk_tokens: int = 0  # the blocks' MLPs planned in chunks of this many tokens (0: unchunked)

    @property
    def retain_grads(self) -> bool:
        return self.max_grad_norm is not None

    @property
    def attention_tile_tokens(self) -> int:
        """The attention tile the plans were sized and timed with (0: whole segments, or no
        segment attention at this length): the engine runs the planner's choice
        (``Config.attention_tile_tokens`` unset)."""
        return attention_tile_of(self.sizes, self.seq)

    def peak_breakdown(self, candidate: Candidate | None = None) -> list[PeakBreakdown]:
        """What ``candidate``'s (default: the best plan's) estimated activation peak on each device
        entry is made of: the phase and the bytes of each kind of tensor alive then."""
        c = candidate or self.best
        return peak_breakdown(self.sizes, self.hardware, c.plan, seq=self.seq, global_batch=self.global_batch,
                              precision=self.precision, mlp_chunk=self.mlp_chunk_tokens)

    def seconds(self, candidate: Candidate | None = None) -> float:
        """The step time the search ranked ``candidate`` (default: the best plan) by: the clipped
        step under ``max_grad_norm`` (:func:`ranking_seconds`)."""
        return ranking_seconds(candidate or self.best, self.max_grad_norm is not None)

    def config_kwargs(self, candidate: Candidate | None = None) -> dict:
        """``tinypipe.Config`` fields that realise ``candidate`` (default: the best plan); or pass
        the plan itself: ``Engine(model, config, plan=candidate.plan)``. A plan with state on the
        SSD adds the offload directory and the budget and workload the engine chooses it from."""
        c = candidate or self.best
        out = c.plan.settings()
        out["devices"] = [f"cuda:{i}" for i in range(self.gpus)]
        out["precision"] = self.precision
        out["max_grad_norm"] = self.max_grad_norm
        if self.mlp_chunk_tokens:
            out["mlp_chunk_tokens"] = self.mlp_chunk_tokens
        if self.attention_tile_tokens:
            out["attention_tile_tokens"] = self.attention_tile_tokens
        if c.plan.offload:  # the engine derives the same offload set from these (offload_dir: yours)
            if self.ssd is not None and self.ssd.directory is not None:
                out["offload_dir"] = self.ssd.directory
            out.update(cpu_memory_bytes=self.cpu_memory_bytes, seq_len=self.seq,
                       global_batch=self.global_batch)
        return out

    def offload_dict(self, candidate: Candidate | None = None) -> dict:
        """What goes where (per kind: layers, bytes on the SSD and in DRAM), the staging pool, the
        disk space, the SSD bytes per step, the bound and the batch that hides the I/O."""
        c = candidate or self.best
        pools = staging_shape(self.sizes, c.plan, precision=self.precision)
        kinds = summary(self.sizes, c.plan, self.precision, retain_grads=self.retain_grads)
        return {
            "ssd": self.ssd.as_dict() if self.ssd else None,
            "kinds": [dataclasses.asdict(k) for k in kinds],
            "staging_pools": dataclasses.asdict(pools),
            "staging_bytes": pools.nbytes,
            "disk_bytes": disk_bytes(self.sizes, c.plan.offload, self.precision),
            "read_bytes_per_step": c.time.ssd_read_bytes,
            "write_bytes_per_step": c.time.ssd_write_bytes,
            "bound": c.time.limit,
            "lanes_s": c.time.lanes(),
            "hiding": self.hiding.as_dict() if self.hiding and c is self.best else None,
        }

    def as_dict(self) -> dict:
        def cand(c: Candidate) -> dict:
            return {
                "settings": c.plan.settings(),
                "plan": c.plan.as_dict(),
                "gpu_need_bytes": c.gpu_need,
                "host_need_bytes": c.host_need,
                "memory": c.memory.as_dict(),
                "time": c.time.as_dict(),
                "tokens_per_s": c.tokens_per_s,
            }

        s = self.sizes
        return {
            "model": {"name": self.model_name, "model_type": s.model_type, "params": s.param_count,
                      "blocks": s.num_blocks, "hidden": s.hidden, "vocab": s.vocab, "tied": s.tied,
                      "embed_numel": s.embed_numel, "head_numel": s.head_numel, "block_numel": s.slot_numel,
                      "block_act_bytes_per_token": s.act_bytes_per_token.get(self.precision)},
            "hardware": self.hardware.as_dict(),
            "budget": {"gpus": self.gpus, "gpu_memory_bytes": self.gpu_memory_bytes,
                       "cpu_memory_bytes": self.cpu_memory_bytes},
            "workload": {"seq": self.seq, "global_batch": self.global_batch, "precision": self.precision,
                         "max_grad_norm": self.max_grad_norm, "mlp_chunk_tokens": self.mlp_chunk_tokens},
            "considered": self.considered,
            "fitting": self.fitting,
            "best": cand(self.best),
            "config": self.config_kwargs(),
            "pareto": [cand(c) for c in self.pareto],
            "notes": self.notes,
            **({"offload": self.offload_dict()} if self.ssd is not None else {}),
        }


#: Said when a chosen plan has parts the ``tinypipe.Config`` fields cannot express.
PLAN_ONLY_NOTE = ("the {what} are part of the plan, not of the Config fields: pass the plan "
                  "(--save-plan FILE; Engine(model, config, plan=Plan.load(FILE))) or let the engine plan "
                  "(no packing knob set)")


def ranking_seconds(c: Candidate, clipping: bool) -> float:
    """The step time the search ranks by: under clipping (``max_grad_norm`` set) the step where it
    triggers -- at HF Trainer's default of 1.0 fine-tuning clips on nearly every step, and the
    host AdamW pass it defers (:mod:`tinypipe.planner.clipped`) is what plans differ in most
    then -- otherwise the plain step."""
    if clipping:
        assert c.time.clipped_step_s is not None  # evaluate() predicts it under max_grad_norm
        return c.time.clipped_step_s
    return c.time.step_s


def _pareto(cands: list[Candidate], clipping: bool = False) -> list[Candidate]:
    """Plans no other plan beats on both step time and GPU need (fastest first; ``clipping``:
    by :func:`ranking_seconds`)."""
    front: list[Candidate] = []
    for c in sorted(cands, key=lambda c: (ranking_seconds(c, clipping), c.gpu_need, c.host_need)):
        if not front or c.gpu_need < front[-1].gpu_need:
            front.append(c)
    return front


def plan_for(config: transformers.PretrainedConfig | str, hardware: HardwareSpec | str, *, gpus: int,
             gpu_memory_bytes: int | None = None, cpu_memory_bytes: int, seq: int, global_batch: int,
             precision: Precision = "bf16", max_grad_norm: float | None = None,
             host_grad_buffers: int | None = None, max_pareto: int = 8, lora: LoraSettings | None = None,
             device_optimizer: DeviceOptimizer | None = None,
             resident_packs: int | None = None, ssd: SsdSpec | None = None,
             hiding_search: bool = True, keep_activations: bool | None = None,
             host_shards: int = 1, assist_updates: bool = True, turn_packs: int | None = None,
             mlp_chunk_tokens: int | None = None, document_tokens: int | None = None,
             attention_tile_tokens: int | None = None) -> PlanResult:
    """:func:`plan` with the request's fields as keywords (each documented on
    :class:`~tinypipe.planner.request.PlanRequest`), kept for scripts, benches and tests that call
    the planner directly; tinypipe's own entries (the engine, ``tinypipe plan``, the replica
    search) build a :class:`PlanRequest`. ``gpu_memory_bytes`` 0 or None: the hardware's.

    Raises :class:`PlanDoesNotFitError` (one line: what the smallest plan needs) when nothing fits.
    """
    request = PlanRequest(model_config=config, gpus=gpus, gpu_memory_bytes=gpu_memory_bytes or None,
                          cpu_memory_bytes=cpu_memory_bytes, seq=seq, global_batch=global_batch,
                          precision=precision, max_grad_norm=max_grad_norm,
                          host_grad_buffers=host_grad_buffers, max_pareto=max_pareto, lora=lora,
                          device_optimizer=device_optimizer, resident_packs=resident_packs, ssd=ssd,
                          hiding_search=hiding_search, keep_activations=keep_activations,
                          host_shards=host_shards, assist_updates=assist_updates, turn_packs=turn_packs,
                          mlp_chunk_tokens=mlp_chunk_tokens, document_tokens=document_tokens,
                          attention_tile_tokens=attention_tile_tokens)
    return plan(request, hardware)


def plan(request: PlanRequest, hardware: HardwareSpec | str) -> PlanResult:
    """The fastest plan for ``request`` that fits its budgets on ``hardware`` (a preset name, a
    profile file or a spec), plus the time-memory Pareto front. The request was validated when it
    was built; what each field does is documented on :class:`PlanRequest`. In short: with ``lora``
    the model is sized with those adapters (only they train; the base is frozen at compute
    precision); ``device_optimizer``, ``resident_packs``, ``keep_activations`` and ``turn_packs``
    fix those choices (None: searched, :func:`device_optimizer_options`,
    :func:`~tinypipe.planner.grow.with_resident_packs`,
    :func:`~tinypipe.planner.grow.with_kept_activations`, :func:`~tinypipe.planner.grow.with_turn`).
    ``ssd``: host memory becomes a real limit with the SSD as the overflow
    (:class:`~tinypipe.planner.spill.Spill`), and the result says from which global batch its I/O
    is hidden (unless ``hiding_search`` is off). ``host_shards`` > 1: each plan's host need is one
    sharded rank's (:func:`~tinypipe.planner.sharded_host.sharded_candidate`) against
    ``cpu_memory_bytes``, one replica's budget. ``assist_updates``: under clipping each fitting plan
    gets the layers whose clipped updates its GPU steps on their way up (``Plan.assisted``), never
    for sharded replicas. ``mlp_chunk_tokens`` (None: the engine's automatic choice,
    :func:`~tinypipe.models.chunked_mlp.mlp_chunk_tokens_for`) bounds the MLP intermediates in every
    plan's activation estimate; the result says what was planned with.

    ``attention_tile_tokens`` None: where long segments attend in tiles, the search runs once per
    tile of :data:`~tinypipe.models.tiled_attention.ATTENTION_TILE_OPTIONS` and keeps the fastest
    plan that fits (:func:`_fastest_tile`).

    Raises :class:`PlanDoesNotFitError` (one line: what the smallest plan needs) when nothing fits.
    """
    r = request
    if r.attention_tile_tokens is None:
        tiles = attention_tile_options(str(getattr(r.config, "model_type", "")), r.seq)
        if len(tiles) > 1:
            return _fastest_tile(r, hardware, tiles)
    cfg, name = r.config, r.model_name
    gpus, seq, global_batch, precision = r.gpus, r.seq, r.global_batch, r.precision
    max_grad_norm, lora, ssd, host_shards = r.max_grad_norm, r.lora, r.ssd, r.host_shards
    cpu_memory_bytes = r.cpu_memory_bytes
    resident_packs, keep_activations = r.resident_packs, r.keep_activations
    hw = load_hardware(hardware)
    if ssd is not None:
        hw = ssd.apply(hw)
    gpu_mem = int(r.gpu_memory_bytes) if r.gpu_memory_bytes else hw.gpu_memory_bytes
    notes = []
    sizes = lora_sizes(cfg, lora) if lora is not None else model_sizes(cfg)
    if r.attention_tile_tokens is not None:
        sizes = dataclasses.replace(sizes, attention_tile=r.attention_tile_tokens)
    if r.document_tokens is not None and r.document_tokens < seq:
        sizes = dataclasses.replace(sizes, document_tokens=r.document_tokens)
        notes.append(f"attention priced for documents of {r.document_tokens} tokens (token-weighted "
                     f"mean) packed into each {seq}-token sequence")
    if lora is not None:
        notes.append(f"{sizes.lora}: {sizes.train_total / 1e6:.1f} M trainable elements, "
                     f"{sizes.frozen_total / 1e9:.2f} G frozen")
    if hw.layer_profile is not None:
        if hw.layer_profile.precision == precision:
            notes.append(f"compute times from measured per-layer times ({hw.name}, "
                         f"{len(hw.layer_profile.points)} points)")
        else:
            notes.append(f"the hardware profile was measured at {hw.layer_profile.precision}, not "
                         f"{precision}: compute times are FLOP-rate estimates")
    if sizes.act_source != "probe":
        notes.append("activation sizes come from a generic formula (the probe model could not be built)")

    mbs = micro_batch_options(global_batch)
    clipping = max_grad_norm is not None  # rank by the clipped step (ranking_seconds)
    # a measured profile knows the rate up to its largest micro-batch: search up to there
    plateau = REFERENCE_TOKENS
    if hw.layer_profile is not None and hw.layer_profile.precision == precision:
        plateau = max(plateau, max(p.tokens for p in hw.layer_profile.points))
    # which resident layers keep their AdamW on the GPU: a tied head owns only its final norm
    dopts = device_optimizer_options(sizes) if r.device_optimizer is None else (r.device_optimizer,)

    # each plan gets the assisted layers that shorten its (clipped) step, where it can hold their
    # scratch (not for sharded replicas: they step their shards, and their leftover work is theirs)
    assist = gpu_mem if r.assist_updates and host_shards == 1 else None

    mlp_chunk = mlp_chunk_tokens_for(r.mlp_chunk_tokens, sizes.intermediate, dtype_bytes(precision), seq)
    if mlp_chunk:
        notes.append(f"MLPs in chunks of {mlp_chunk} tokens "
                     "(a block's MLP intermediates bounded by a chunk's)")

    def ev(plan: Plan, peaks: Sequence[int] | None = None, batch: int = global_batch) -> Candidate:
        c = evaluate(sizes, hw, plan, seq=seq, global_batch=batch, precision=precision,
                     max_grad_norm=max_grad_norm, host_grad_buffers=r.host_grad_buffers, peaks=peaks,
                     assist_within=assist, mlp_chunk=mlp_chunk)
        return c if host_shards == 1 else sharded_candidate(c, sizes, host_shards, max_grad_norm is not None)

    spill = Spill(sizes, ssd, cpu_memory_bytes, precision=precision, retain_grads=max_grad_norm is not None,
                  mlp_chunk=mlp_chunk)

    def settle(c: Candidate) -> Candidate | None:
        return spill.settle(c, ev)

    cands: list[Candidate] = []
    fits: list[Candidate] = []
    for pack in pack_options(sizes.num_blocks):
        num_packs = len(pack) if isinstance(pack, tuple) else -(-sizes.num_blocks // pack)
        largest = max(pack) if isinstance(pack, tuple) else pack
        windows = [w for w in WINDOWS if w <= max(1, largest)]
        if resident_packs and resident_packs > num_packs:  # a fixed count this packing cannot hold
            continue
        for stash in stash_options(num_packs):
            for b in useful_micro_batches(mbs, mbs, seq, plateau):
                forwards = [x for x in (b, 2 * b, 4 * b, global_batch) if x in mbs and x >= b]
                for f in useful_micro_batches(forwards, mbs, seq, plateau):
                    peaks = None
                    for w in windows:
                        for dopt in dopts:
                            try:
                                option = make_plan(sizes.num_blocks, pack_size=pack, micro_batch_size=f,
                                                   backward_micro_batch_size=b, num_devices=gpus,
                                                   prefetch_window=w, stash=stash, tied=sizes.tied,
                                                   device_optimizer=dopt, resident_packs=resident_packs or 0)
                            except ConfigError:  # fixed resident packs this placement splits across devices
                                if not resident_packs:
                                    raise
                                continue
                            c = ev(option, peaks)
                            peaks = [c.memory.devices[k]["activations_peak"] for k in c.memory.devices]
                            cands.append(c)
                            settled = settle(c) if c.gpu_need <= gpu_mem else None
                            if settled is not None:
                                fits.append(settled)
    if not cands:
        raise ConfigError(f"no packing of the {sizes.num_blocks} blocks on {gpus} GPU(s) can keep "
                          f"{resident_packs} packs resident (each needs its forward and backward on one "
                          "device)")
    if not fits:
        gpu_ok = any(c.gpu_need <= gpu_mem for c in cands)

        def peak_of(c: Candidate) -> PeakBreakdown:
            parts = peak_breakdown(sizes, hw, c.plan, seq=seq, global_batch=global_batch, precision=precision,
                                   mlp_chunk=mlp_chunk)
            return max(parts, key=lambda b: b.total)

        why = (spill.why_not() if gpu_ok else None) or _why_not(cands, gpu_mem, cpu_memory_bytes, gpus,
                                                                 ssd is not None, peak_of)
        raise PlanDoesNotFitError(why)
    if resident_packs is None:  # spend what GPU memory the fastest plans leave on resident packs
        more, more_fits = with_resident_packs(_pareto(fits, clipping)[:RESIDENT_SEEDS], ev, settle, gpu_mem)
        cands += more
        fits += more_fits
    if keep_activations is None:  # spend what GPU memory is left on not recomputing packs

        def saved_per_byte(plan: Plan) -> list[float]:
            rec = recompute_seconds(sizes, plan, hw, batch=global_batch, seq=seq, precision=precision)
            held = [kept_bytes(sizes, plan, q, batch=global_batch, seq=seq, precision=precision)
                    for q in range(plan.num_packs)]
            return [r / max(1, h) for r, h in zip(rec, held)]

        seeds = _pareto([c for c in fits if not c.plan.backward_micro_batch_size % c.plan.micro_batch_size],
                        clipping)
        more, more_fits = with_kept_activations(seeds[:KEEP_SEEDS], ev, settle, gpu_mem, saved_per_byte,
                                                grow_resident=resident_packs is None,
                                                streamed=not sizes.quantize)
        cands += more
        fits += more_fits
        if r.turn_packs is None:
            turned, turned_fits = with_turn(_pareto(fits, clipping)[:TURN_SEEDS], ev, settle, gpu_mem,
                                            saved_per_byte, streamed=not sizes.quantize)
            cands += turned
            fits += turned_fits
            if resident_packs is None:  # a turn plan's first packs resident: the host lane's last work
                turn_seeds = _pareto(turned_fits, clipping)[:TURN_SEEDS]
                more, more_fits = with_resident_packs(turn_seeds, ev, settle, gpu_mem)
                cands += more
                fits += more_fits
    elif keep_activations:
        more, fits = keep_all(fits, ev, settle, gpu_mem, streamed=not sizes.quantize)
        cands += more
        if not fits:
            raise PlanDoesNotFitError("no plan that fits can keep the activations of its keepable packs "
                                      "(resident packs, the last pack) on the GPU: try without "
                                      "keep_activations")
    front = _pareto(fits, clipping)
    fastest = ranking_seconds(front[0], clipping)
    best = min((c for c in front if ranking_seconds(c, clipping) <= fastest * (1 + NEAR_FASTEST)),
               key=lambda c: c.gpu_need)
    if best.plan.assisted:
        notes.append(PLAN_ONLY_NOTE.format(what="assisted layers"))
    hiding = None
    if ssd is not None and best.plan.offload and r.hiding_search:
        fresh = Spill(sizes, ssd, cpu_memory_bytes, precision=precision,
                      retain_grads=max_grad_norm is not None, mlp_chunk=mlp_chunk)
        hiding = hiding_batch(sizes, hw, best.plan, lambda p, b: ev(p, None, b), fresh, seq=seq,
                              precision=precision, gpu_mem=gpu_mem)
        if hiding.batch is None or not hiding.fits_gpu:  # these knobs cannot get there: re-plan

            def best_at(batch: int) -> Candidate:
                return plan(dataclasses.replace(r, model_config=cfg, gpu_memory_bytes=gpu_mem,
                                                global_batch=batch, hiding_search=False, host_shards=1,
                                                max_pareto=8, mlp_chunk_tokens=mlp_chunk), hw).best

            hiding = replanned_hiding(best_at, sizes, hw, start=global_batch, seq=seq, precision=precision,
                                      mlp_chunk=mlp_chunk)
    return PlanResult(best=best, pareto=front[:r.max_pareto], sizes=sizes, hardware=hw, gpus=gpus,
                      gpu_memory_bytes=gpu_mem, cpu_memory_bytes=cpu_memory_bytes, seq=seq,
                      global_batch=global_batch, precision=precision, max_grad_norm=max_grad_norm,
                      considered=len(cands), fitting=len(fits), model_name=name, notes=notes, ssd=ssd,
                      hiding=hiding, mlp_chunk_tokens=mlp_chunk)


def _fastest_tile(request: PlanRequest, hardware: HardwareSpec | str, tiles: Sequence[int]) -> PlanResult:
    """:func:`plan` once per attention tile (ascending): the leanest of the fitting plans within
    :data:`NEAR_FASTEST` of the fastest, with a note; when none fits, the smallest tile's refusal
    (it needs the least memory). Why a search: a larger tile runs faster but holds more in the
    attention's backward, and at the longest sequences that is what decides whether a plan fits."""
    results: list[PlanResult] = []
    refusal: PlanDoesNotFitError | None = None
    for tile in sorted(tiles):
        try:
            results.append(plan(dataclasses.replace(request, attention_tile_tokens=tile), hardware))
        except PlanDoesNotFitError as exc:
            refusal = refusal or exc
    if not results:
        assert refusal is not None
        raise refusal
    clipping = request.max_grad_norm is not None
    fastest = min(ranking_seconds(res.best, clipping) for res in results)
    near = [res for res in results if ranking_seconds(res.best, clipping) <= fastest * (1 + NEAR_FASTEST)]
    best = min(near, key=lambda res: res.best.gpu_need)
    tried = ", ".join(str(t) for t in sorted(tiles))
    note = (f"attention in tiles of {best.attention_tile_tokens} tokens: the fastest of {tried} "
            f"that fits (Config.attention_tile_tokens to fix one)")
    return dataclasses.replace(best, notes=[*best.notes, note],
                               considered=sum(res.considered for res in results))


def _alternatives(items: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _why_not(cands: list[Candidate], gpu_mem: int, cpu_mem: int, gpus: int, ssd: bool = False,
             peak_of: Callable[[Candidate], PeakBreakdown] | None = None) -> str:
    """One line: what the smallest configuration needs and what to try (``ssd``: host memory
    was not the limit, the SSD takes the overflow). It suggests only what would change the
    answer: not LoRA to a LoRA run, the SSD tier only where host memory is what is short and no
    offload directory was given. ``peak_of``: where GPU memory is short, the leanest plan's
    activation peak taken apart -- its four largest parts are named, so the reader sees what
    to change (tokens per micro-batch, the batch, the tile)."""
    host_ok = cands if ssd else [c for c in cands if c.host_need <= cpu_mem]
    gpu_ok = [c for c in cands if c.gpu_need <= gpu_mem]
    min_host = min(cands, key=lambda c: c.host_need)
    min_gpu = min(cands, key=lambda c: c.gpu_need)
    host = min_host.memory.host
    frozen = next((k for k in host if k.startswith("frozen_weights")), None)  # "frozen_weights (nf4)"
    lora = frozen is not None and bool(host[frozen])
    ssd_hint = "" if ssd else ", --offload-dir DIR (the SSD tier)"
    if not host_ok:
        if frozen is not None and lora:
            need, have = gib_pair(min_host.host_need, cpu_mem)
            return (f"needs {need} host memory even with LoRA, "
                    f"have {have} ({gib_text(host[frozen])} of it the frozen base weights); "
                    + _alternatives(["add RAM",
                                     *([] if "(" in frozen else ["quantize the base (--quantize nf4)"]),
                                     *([] if ssd else ["put them on an SSD (--offload-dir DIR)"])]))
        need, have = gib_pair(min_host.host_need, cpu_mem)
        return (f"needs {need} host memory, have {have} "
                f"({gib_text(host['master_weights'] + host['optimizer_state'])} of it "
                f"fp32 master weights + AdamW state); try --lora{ssd_hint} or more RAM")
    if not gpu_ok:
        held = ""
        if peak_of is not None:
            peak = peak_of(min_gpu)
            held = (f"; its activation peak ({peak.phase}) holds "
                    + ", ".join(f"{label} {gib_text(b)}" for label, b in peak.parts[:4]))
        return (f"needs {gib_text(min_gpu.gpu_need)} GPU memory per device ({min_gpu.describe()}{held}), "
                f"have {gib_text(gpu_mem)}; try a shorter --seq-len, a smaller --global-batch"
                + (" or more GPUs" if lora else ", more GPUs or --lora"))
    # each budget can be met alone, but no plan meets both: the GPU-lean plans stash on the host
    best = min(host_ok, key=lambda c: c.gpu_need)
    return (f"needs {gib_text(best.gpu_need)} GPU memory per device with host memory under "
            f"{gib_text(cpu_mem)} (or {gib_text(min_gpu.host_need)} host memory at "
            f"{gib_text(min_gpu.gpu_need)} GPU memory); have "
            f"{gib_text(gpu_mem)} GPU memory; try a shorter --seq-len{ssd_hint}, more RAM or more GPUs")
