"""Offline planner: exact layer sizes from a config, byte-exact static memory plus estimated
activation peaks, a calibrated step-time model, and a search over packings, micro-batches,
prefetch windows and stash placements (``tinypipe plan``). No GPU, no weights.

Public API::

    from tinypipe.planner import PlanRequest, format_plan, plan
    request = PlanRequest(model_config="llama-3.1-8b", gpus=2, gpu_memory_bytes=24 * 2**30,
                          cpu_memory_bytes=128 * 2**30, seq=4096, global_batch=16)
    result = plan(request, "rtx4090-pcie4")  # or plan_for(model, hardware, **the same fields)
    print(format_plan(result))
    engine = tinypipe.Engine(model, tinypipe.Config(**result.config_kwargs()))

With an SSD for the state that does not fit the host (``ssd=ssd_spec(hw, directory=..., measure=True)``
or ``SsdSpec(read_gbps, write_gbps)``) the result's plan carries ``Plan.offload`` and says from which
global batch the SSD's I/O is hidden (``result.hiding``).
"""

from tinypipe.planner.cost import StepTime, predict_step_time
from tinypipe.planner.estimate import activation_peaks, device_static_bytes, estimate_memory, host_bytes
from tinypipe.planner.hardware import HARDWARE, HardwareSpec, load_hardware, parse_bytes
from tinypipe.planner.presets import PRESETS, load_model_config, preset_names
from tinypipe.planner.format import format_plan
from tinypipe.planner.request import PlanRequest
from tinypipe.planner.search import Candidate, PlanResult, evaluate, plan, plan_for
from tinypipe.planner.sizes import ModelSizes, model_sizes
from tinypipe.planner.ssd import SsdSpec, ssd_spec

__all__ = [
    "HARDWARE",
    "PRESETS",
    "Candidate",
    "HardwareSpec",
    "ModelSizes",
    "PlanRequest",
    "PlanResult",
    "SsdSpec",
    "StepTime",
    "activation_peaks",
    "device_static_bytes",
    "estimate_memory",
    "evaluate",
    "format_plan",
    "host_bytes",
    "load_hardware",
    "load_model_config",
    "model_sizes",
    "parse_bytes",
    "plan",
    "plan_for",
    "predict_step_time",
    "preset_names",
    "ssd_spec",
]
