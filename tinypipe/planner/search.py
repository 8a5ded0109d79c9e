"""Plan search: every combination of the options (:mod:`tinypipe.planner.options`: packings,
micro-batch sizes, prefetch windows, stash placements, embedding/head on the GPU), then resident
packs on the fastest; estimate each plan's memory and step time, keep those that fit, return the
fastest and the time-memory Pareto front (printed by :mod:`tinypipe.planner.format`).

Fitting means, for every device, static pools + estimated activation peak + headroom <= the
GPU's memory, and host bytes (tinypipe-owned, exact) + the process baseline <= the host budget.
The headroom covers what the estimate leaves out: the CUDA context (outside PyTorch's allocator)
and allocator fragmentation (:data:`GPU_CONTEXT_BYTES`, :data:`FRAGMENTATION`). The host baseline
(:data:`HOST_BASELINE_BYTES`) is the Python process with torch and transformers loaded (measured
~1.8 GB above tinypipe's own bytes on the H200 box).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import transformers

from tinypipe.config import PRECISIONS, Precision
from tinypipe.errors import ConfigError, PlanDoesNotFitError
from tinypipe.memory.report import MemoryReport
from tinypipe.planner.cost import REFERENCE_TOKENS, StepTime, predict_step_time
from tinypipe.planner.estimate import estimate_memory
from tinypipe.planner.hardware import HardwareSpec, load_hardware
from tinypipe.planner.options import (
    WINDOWS,
    device_optimizer_options,
    micro_batch_options,
    pack_options,
    stash_options,
    useful_micro_batches,
)
from tinypipe.planner.presets import load_model_config
from tinypipe.planner.sizes import ModelSizes, lora_sizes, model_sizes
from tinypipe.schedule.plan import DeviceOptimizer, Plan, make_plan
from tinypipe.units import GIB, gib_text

if TYPE_CHECKING:
    from tinypipe.lora.settings import LoraSettings

#: GPU memory the CUDA context and library handles take outside PyTorch's allocator.
GPU_CONTEXT_BYTES = 512 * 1024**2
#: Share of the activation peak added for allocator fragmentation (expandable segments on).
FRAGMENTATION = 0.10
#: Host memory of the process beyond tinypipe's accounted bytes (interpreter, libraries, model
#: object shells, tokenizer, data).
HOST_BASELINE_BYTES = 3 * GIB
#: Plans within this fraction of the fastest count as equally fast; the leanest of them is chosen.
NEAR_FASTEST = 0.01


@dataclass
class Candidate:
    """One evaluated plan."""

    plan: Plan
    memory: MemoryReport
    time: StepTime
    gpu_need: int  # the fullest device: static + activation peak + headroom
    host_need: int  # tinypipe's host bytes + process baseline

    @property
    def tokens_per_s(self) -> float:
        return self.time.tokens_per_s

    def describe(self) -> str:
        return self.plan.describe()


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

    def config_kwargs(self, candidate: Candidate | None = None) -> dict:
        """``tinypipe.Config`` fields that realise ``candidate`` (default: the best plan); or pass
        the plan itself: ``Engine(model, config, plan=candidate.plan)``."""
        c = candidate or self.best
        out = c.plan.settings()
        out["devices"] = [f"cuda:{i}" for i in range(self.gpus)]
        out["precision"] = self.precision
        out["max_grad_norm"] = self.max_grad_norm
        return out

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
                         "max_grad_norm": self.max_grad_norm},
            "considered": self.considered,
            "fitting": self.fitting,
            "best": cand(self.best),
            "config": self.config_kwargs(),
            "pareto": [cand(c) for c in self.pareto],
            "notes": self.notes,
        }


#: Pareto plans (fastest first) that the search tries again with resident packs.
RESIDENT_SEEDS = 4


def _with_resident_packs(sizes: ModelSizes, hw: HardwareSpec, seeds: list[Candidate], *, seq: int,
                         global_batch: int, precision: Precision, max_grad_norm: float | None,
                         host_grad_buffers: int | None, gpu_mem: int, cpu_mem: int) -> list[Candidate]:
    """Each seed plan with 1, 2, ... of its first packs kept resident on the GPU (stepped there),
    for as long as that fits and its pack placement allows it (one device per resident pack).

    Resident packs trade GPU memory (18 bytes per parameter in bf16: weights, fp32 gradient,
    master and moments) for link traffic and host AdamW work; the first packs come first because
    their host updates are the ones left after the backward."""
    out = []
    for seed in seeds:
        peaks = [seed.memory.devices[n]["activations_peak"] for n in seed.memory.devices]
        for r in range(1, seed.plan.num_packs + 1):
            try:
                plan = dataclasses.replace(seed.plan, resident_packs=r)
            except ConfigError:  # this pack's forward and backward run on different devices
                break
            c = evaluate(sizes, hw, plan, seq=seq, global_batch=global_batch, precision=precision,
                         max_grad_norm=max_grad_norm, host_grad_buffers=host_grad_buffers, peaks=peaks)
            out.append(c)
            if c.gpu_need > gpu_mem or c.host_need > cpu_mem:
                break
    return out


def _gpu_need(report: MemoryReport) -> int:
    worst = 0
    for name, cats in report.devices.items():
        act = cats.get("activations_peak", 0)
        need = report.device_total(name) + act + int(FRAGMENTATION * act) + GPU_CONTEXT_BYTES
        worst = max(worst, need)
    return worst


def evaluate(sizes: ModelSizes, hardware: HardwareSpec, plan: Plan, *, seq: int, global_batch: int,
             precision: Precision = "bf16", max_grad_norm: float | None = None,
             host_grad_buffers: int | None = None, peaks: Sequence[int] | None = None) -> Candidate:
    """Estimate ``plan``'s memory and step time on ``plan.num_devices`` GPUs of ``hardware``
    (``peaks``: activation peaks already estimated for the same plan with another window)."""
    devices = [f"cuda:{i}" for i in range(plan.num_devices)]
    prof = hardware.layer_profile
    act = None
    if prof is not None and prof.precision == precision:  # measured saved activations of this block shape
        act = prof.activation_bytes_for(sizes.block_params[0], sizes.num_heads * sizes.head_dim)
    mem = estimate_memory(sizes, plan, batch=global_batch, seq=seq, precision=precision, devices=devices,
                          host_grad_buffers=host_grad_buffers, max_grad_norm=max_grad_norm, peaks=peaks,
                          act_per_token=act)
    t = predict_step_time(sizes, plan, hardware, batch=global_batch, seq=seq, precision=precision)
    return Candidate(plan, mem, t, _gpu_need(mem), mem.host_total + HOST_BASELINE_BYTES)


def _pareto(cands: list[Candidate]) -> list[Candidate]:
    """Plans no other plan beats on both step time and GPU need (fastest first)."""
    front: list[Candidate] = []
    for c in sorted(cands, key=lambda c: (c.time.step_s, c.gpu_need, c.host_need)):
        if not front or c.gpu_need < front[-1].gpu_need:
            front.append(c)
    return front


def _resolve(config: transformers.PretrainedConfig | str) -> tuple[transformers.PretrainedConfig, str]:
    if isinstance(config, transformers.PretrainedConfig):
        return config, getattr(config, "name_or_path", "") or getattr(config, "model_type", "")
    return load_model_config(str(config)), str(config)


def plan_for(config: transformers.PretrainedConfig | str, hardware: HardwareSpec | str, *, gpus: int,
             gpu_memory_bytes: int | None = None, cpu_memory_bytes: int, seq: int, global_batch: int,
             precision: Precision = "bf16", max_grad_norm: float | None = None,
             host_grad_buffers: int | None = None, max_pareto: int = 8, lora: LoraSettings | None = None,
             device_optimizer: DeviceOptimizer | None = None,
             resident_packs: int | None = None) -> PlanResult:
    """The fastest plan that fits ``gpus`` GPUs of ``gpu_memory_bytes`` (default: the hardware's)
    and ``cpu_memory_bytes`` of host memory, plus the time-memory Pareto front. With ``lora`` the
    model is sized with those adapters (only they train; the base is frozen at compute precision).
    ``device_optimizer`` fixes that choice (default: searched, see :func:`device_optimizer_options`);
    ``resident_packs`` likewise (default: searched, see :func:`_with_resident_packs`).

    Raises :class:`PlanDoesNotFitError` (one line: what the smallest plan needs) when nothing fits.
    """
    if gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {gpus}")
    if seq < 2:
        raise ConfigError(f"sequence length must be >= 2, got {seq}")
    if global_batch < 1:
        raise ConfigError(f"global batch must be >= 1, got {global_batch}")
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ConfigError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    hw = load_hardware(hardware)
    gpu_mem = int(gpu_memory_bytes) if gpu_memory_bytes else hw.gpu_memory_bytes
    if cpu_memory_bytes <= 0:
        raise ConfigError("host memory budget must be positive")
    cfg, name = _resolve(config)
    max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    notes = []
    if isinstance(max_pos, int) and seq > max_pos:
        raise ConfigError(f"sequence length {seq} exceeds the model's max_position_embeddings {max_pos}")
    sizes = lora_sizes(cfg, lora) if lora is not None else model_sizes(cfg)
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
    # a measured profile knows the rate up to its largest micro-batch: search up to there
    plateau = REFERENCE_TOKENS
    if hw.layer_profile is not None and hw.layer_profile.precision == precision:
        plateau = max(plateau, max(p.tokens for p in hw.layer_profile.points))
    # which resident layers keep their AdamW on the GPU: a tied head owns only its final norm
    dopts = device_optimizer_options(sizes) if device_optimizer is None else (device_optimizer,)
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
                                plan = make_plan(sizes.num_blocks, pack_size=pack, micro_batch_size=f,
                                                 backward_micro_batch_size=b, num_devices=gpus,
                                                 prefetch_window=w, stash=stash, tied=sizes.tied,
                                                 device_optimizer=dopt, resident_packs=resident_packs or 0)
                            except ConfigError:  # fixed resident packs this placement splits across devices
                                if not resident_packs:
                                    raise
                                continue
                            c = evaluate(sizes, hw, plan, seq=seq, global_batch=global_batch,
                                         precision=precision, max_grad_norm=max_grad_norm,
                                         host_grad_buffers=host_grad_buffers, peaks=peaks)
                            peaks = [c.memory.devices[k]["activations_peak"] for k in c.memory.devices]
                            cands.append(c)
                            if c.gpu_need <= gpu_mem and c.host_need <= cpu_memory_bytes:
                                fits.append(c)
    if not cands:
        raise ConfigError(f"no packing of the {sizes.num_blocks} blocks on {gpus} GPU(s) can keep "
                          f"{resident_packs} packs resident (each needs its forward and backward on one "
                          "device)")
    if not fits:
        raise PlanDoesNotFitError(_why_not(cands, gpu_mem, cpu_memory_bytes, gpus))
    if resident_packs is None:  # spend what GPU memory the fastest plans leave on resident packs
        more = _with_resident_packs(sizes, hw, _pareto(fits)[:RESIDENT_SEEDS], seq=seq,
                                    global_batch=global_batch, precision=precision,
                                    max_grad_norm=max_grad_norm, host_grad_buffers=host_grad_buffers,
                                    gpu_mem=gpu_mem, cpu_mem=cpu_memory_bytes)
        cands += more
        fits += [c for c in more if c.gpu_need <= gpu_mem and c.host_need <= cpu_memory_bytes]
    front = _pareto(fits)
    fastest = front[0].time.step_s
    best = min((c for c in front if c.time.step_s <= fastest * (1 + NEAR_FASTEST)), key=lambda c: c.gpu_need)
    return PlanResult(best=best, pareto=front[:max_pareto], sizes=sizes, hardware=hw, gpus=gpus,
                      gpu_memory_bytes=gpu_mem, cpu_memory_bytes=cpu_memory_bytes, seq=seq,
                      global_batch=global_batch, precision=precision, max_grad_norm=max_grad_norm,
                      considered=len(cands), fitting=len(fits), model_name=name, notes=notes)


def _why_not(cands: list[Candidate], gpu_mem: int, cpu_mem: int, gpus: int) -> str:
    """One line: what the smallest configuration needs and what to try."""
    host_ok = [c for c in cands if c.host_need <= cpu_mem]
    gpu_ok = [c for c in cands if c.gpu_need <= gpu_mem]
    min_host = min(cands, key=lambda c: c.host_need)
    min_gpu = min(cands, key=lambda c: c.gpu_need)
    if not host_ok:
        host = min_host.memory.host
        frozen = next((k for k in host if k.startswith("frozen_weights")), None)  # "frozen_weights (nf4)"
        if frozen is not None and host[frozen]:
            return (f"needs {gib_text(min_host.host_need)} host memory even with LoRA, "
                    f"have {gib_text(cpu_mem)} ({gib_text(host[frozen])} of it the frozen base weights); "
                    "add RAM" + ("" if "(" in frozen else " or quantize the base (--quantize nf4)"))
        return (f"needs {gib_text(min_host.host_need)} host memory, have {gib_text(cpu_mem)} "
                f"({gib_text(host['master_weights'] + host['optimizer_state'])} of it "
                "fp32 master weights + AdamW state); try --lora or more RAM")
    if not gpu_ok:
        return (f"needs {gib_text(min_gpu.gpu_need)} GPU memory per device ({min_gpu.describe()}), have "
                f"{gib_text(gpu_mem)}; try a shorter --seq-len, a smaller --global-batch, more GPUs "
                "or --lora")
    # each budget can be met alone, but no plan meets both: the GPU-lean plans stash on the host
    best = min(host_ok, key=lambda c: c.gpu_need)
    return (f"needs {gib_text(best.gpu_need)} GPU memory per device with host memory under "
            f"{gib_text(cpu_mem)} (or {gib_text(min_gpu.host_need)} host memory at "
            f"{gib_text(min_gpu.gpu_need)} GPU memory); have "
            f"{gib_text(gpu_mem)} GPU memory; try a shorter --seq-len, more RAM or more GPUs")
