"""One evaluated plan: its memory estimate (GPU per device, host by category) and predicted step
time, and whether it fits.

Fitting means, for every device, static pools + estimated activation peak + headroom <= the
GPU's memory, and host bytes (tinypipe-owned, exact) + the process baseline <= the host budget.
The headroom covers what the estimate leaves out: the CUDA context (outside PyTorch's allocator)
and allocator fragmentation (:data:`GPU_CONTEXT_BYTES`, :data:`FRAGMENTATION`). The host baseline
(:data:`HOST_BASELINE_BYTES`) is the Python process with torch and transformers loaded (measured
~1.8 GB above tinypipe's own bytes on the H200 box).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from tinypipe.config import Precision
from tinypipe.memory.device_pool import assist_scratch_numel
from tinypipe.memory.report import MemoryReport
from tinypipe.planner.cost import StepTime, predict_step_time
from tinypipe.planner.estimate import (PeakBreakdown, activation_breakdown, cpu_activation_bytes,
                                       estimate_memory)
from tinypipe.planner.hardware import HardwareSpec
from tinypipe.planner.sizes import ModelSizes
from tinypipe.schedule.plan import Plan
from tinypipe.units import GIB

#: GPU memory the CUDA context and library handles take outside PyTorch's allocator.
GPU_CONTEXT_BYTES = 512 * 1024**2
#: Share of the activation peak added for allocator fragmentation (expandable segments on).
FRAGMENTATION = 0.10
#: Host memory of the process beyond tinypipe's accounted bytes (interpreter, libraries, model
#: object shells, tokenizer, data).
HOST_BASELINE_BYTES = 3 * GIB


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


def gpu_need(report: MemoryReport) -> int:
    """The fullest device's static pools + activation peak + headroom."""
    worst = 0
    for name, cats in report.devices.items():
        act = cats.get("activations_peak", 0)
        need = report.device_total(name) + act + int(FRAGMENTATION * act) + GPU_CONTEXT_BYTES
        worst = max(worst, need)
    return worst


def evaluate(sizes: ModelSizes, hardware: HardwareSpec, plan: Plan, *, seq: int, global_batch: int,
             precision: Precision = "bf16", max_grad_norm: float | None = None,
             host_grad_buffers: int | None = None, peaks: Sequence[int] | None = None,
             assist_within: int | None = None, mlp_chunk: int = 0) -> Candidate:
    """Estimate ``plan``'s memory and step time on ``plan.num_devices`` GPUs of ``hardware``
    (``peaks``: activation peaks already estimated for the same plan with another window).

    ``assist_within`` (GPU bytes per device): choose the plan's assisted layers (``plan.assisted``
    is replaced) -- those that make its step shorter (under ``max_grad_norm`` its clipped step;
    without, its backward and tail: :func:`~tinypipe.planner.cost.predict_step_time`), if the plan
    still fits that budget with the scratch every device then holds; None: ``plan.assisted`` as
    given. ``mlp_chunk``: the blocks' MLPs run in chunks of that many tokens (0: unchunked;
    :func:`~tinypipe.planner.estimate.activation_peaks`)."""
    clipping = max_grad_norm is not None
    assist = assist_within is not None
    if assist and plan.assisted:
        plan = dataclasses.replace(plan, assisted=())
    devices = _devices(hardware, plan)
    act = profiled_act_per_token(sizes, hardware, precision)

    def memory(p: Plan, peaks: Sequence[int] | None) -> MemoryReport:
        return estimate_memory(sizes, p, batch=global_batch, seq=seq, precision=precision, devices=devices,
                               host_grad_buffers=host_grad_buffers, max_grad_norm=max_grad_norm, peaks=peaks,
                               act_per_token=act, mlp_chunk=mlp_chunk)

    mem = memory(plan, peaks)
    need = gpu_need(mem)
    room = assist and need + 4 * assist_scratch_numel(True) <= assist_within  # type: ignore[operator]
    t = predict_step_time(sizes, plan, hardware, batch=global_batch, seq=seq, precision=precision,
                          clipping=clipping, assist=bool(room), mlp_chunk=mlp_chunk)
    if t.assisted != plan.assisted:  # chosen here: the same plan, with the scratch
        plan = dataclasses.replace(plan, assisted=t.assisted)
        mem = memory(plan, [cats["activations_peak"] for cats in mem.devices.values()])
        need = gpu_need(mem)
    # CPU device entries: their pools are a host category already, their activations are host memory too
    host_need = mem.host_total + cpu_activation_bytes(mem) + HOST_BASELINE_BYTES
    return Candidate(plan, mem, t, need, host_need)


def _devices(hardware: HardwareSpec, plan: Plan) -> list[str]:
    return [f"{hardware.device_kind}:{i}" for i in range(plan.num_devices)]


def profiled_act_per_token(sizes: ModelSizes, hardware: HardwareSpec, precision: Precision) -> float | None:
    """Saved activation bytes per token and block that ``hardware``'s measured layer profile gives
    for this block shape (None: no profile of this precision; the probe model's count is used)."""
    prof = hardware.layer_profile
    if prof is None or prof.precision != precision:
        return None
    return prof.activation_bytes_for(sizes.block_params[0], sizes.num_heads * sizes.head_dim)


def peak_breakdown(sizes: ModelSizes, hardware: HardwareSpec, plan: Plan, *, seq: int, global_batch: int,
                   precision: Precision = "bf16", mlp_chunk: int = 0) -> list[PeakBreakdown]:
    """What :func:`evaluate`'s activation peak of ``plan`` is made of, per device entry
    (:func:`~tinypipe.planner.estimate.activation_breakdown`, with the same inputs)."""
    return activation_breakdown(sizes, plan, batch=global_batch, seq=seq, precision=precision,
                                devices=_devices(hardware, plan),
                                act_per_token=profiled_act_per_token(sizes, hardware, precision),
                                mlp_chunk=mlp_chunk)
