"""The engine plans for itself: when no packing knob is set in :class:`~tinypipe.Config`, choose
them with :func:`~tinypipe.planner.search.plan_for` for the model, the devices and the memory
budgets; refuse to start (one line) when nothing fits. A hand-set plan is kept as is, and checked
against the budgets when the workload (``seq_len``, ``global_batch``) is given.

Budgets: ``Config.gpu_memory_bytes`` or, per CUDA device, its capacity under the per-process
memory cap (``torch.cuda.set_per_process_memory_fraction``), or its free memory plus what this
process already reserved if that is less; on CPU devices the available RAM.
``Config.cpu_memory_bytes`` or the available RAM plus this process's resident memory (the
planner's host need includes the process itself).
"""

from __future__ import annotations

import torch
from torch import nn

from tinypipe.config import Config
from tinypipe.errors import ConfigError, PlanDoesNotFitError
from tinypipe.planner.hardware import HARDWARE, HardwareSpec, load_hardware

GiB = 1024**3
#: Rates for CPU "devices" (only the ranking of plans matters there).
CPU_HARDWARE = HardwareSpec("cpu", 0, 10.0, 10.0, 10.0, 0.2, 0.5, fp32_tflops=0.2,
                            description="CPU devices (tests): host memory is device memory")
#: GPU name fragment -> hardware preset, for the time model when Config.hardware is not given.
_NAME_TO_PRESET = (("h200", "h200-pcie5"), ("h100", "h200-pcie5"), ("4090", "rtx4090-pcie4"),
                   ("3090", "rtx3090-pcie4"), ("a5000", "a5000"), ("l40s", "l40s"), ("a100", "a100-40g-pcie4"))


def _cuda_capacity(device: str) -> int:
    dev = torch.device(device)
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(idx).total_memory
    try:
        frac = float(torch.cuda.get_per_process_memory_fraction(idx))
    except Exception:  # noqa: BLE001 - older torch: no cap readable
        frac = 1.0
    cap = int(total * frac)
    try:
        free, _ = torch.cuda.mem_get_info(idx)
        cap = min(cap, int(free) + int(torch.cuda.memory_reserved(idx)))
    except Exception:  # noqa: BLE001 - no context yet or no driver query: the cap alone
        pass
    return cap


def _available_ram() -> tuple[int, int]:
    import psutil

    return int(psutil.virtual_memory().available), int(psutil.Process().memory_info().rss)


def budgets(cfg: Config) -> tuple[int, int]:
    """(GPU bytes per device, host bytes) the plan must fit."""
    avail, rss = _available_ram()
    gpu = cfg.gpu_memory_bytes
    if gpu is None:
        cuda = [d for d in cfg.devices if d.startswith("cuda")]
        gpu = min(_cuda_capacity(d) for d in sorted(set(cuda))) if cuda else avail
    host = cfg.cpu_memory_bytes if cfg.cpu_memory_bytes is not None else avail + rss
    return int(gpu), int(host)


def hardware_for(cfg: Config) -> HardwareSpec:
    if cfg.hardware is not None:
        return load_hardware(cfg.hardware)
    cuda = [d for d in cfg.devices if d.startswith("cuda")]
    if not cuda:
        return CPU_HARDWARE
    name = torch.cuda.get_device_name(torch.device(cuda[0])).lower()
    for frag, preset in _NAME_TO_PRESET:
        if frag in name:
            return HARDWARE[preset]
    return HARDWARE["rtx4090-pcie4"]


def configure(model: nn.Module, config: Config, plan_given: bool = False):
    """The config the engine runs (packing knobs resolved) and the planner's result (None for a
    hand-set plan). Raises :class:`PlanDoesNotFitError` when no plan -- or the hand-set one, when
    the workload is given -- fits the budgets."""
    from tinypipe.planner.search import evaluate, plan_for
    from tinypipe.planner.sizes import lora_sizes, model_sizes

    have_workload = config.seq_len is not None and config.global_batch is not None
    if any(d.startswith("cuda") for d in config.devices) and not torch.cuda.is_available():
        return config.with_default_knobs(), None  # the device backend reports it, in its words
    if plan_given or not config.auto_plan:
        cfg = config.with_default_knobs()
        if plan_given or not have_workload:
            return cfg, None
        # a hand-set plan with a known workload: check it against the budgets
        gpu, host = budgets(cfg)
        lora = lora_settings_of(model)
        sizes = lora_sizes(model.config, lora) if lora is not None else model_sizes(model.config)
        c = evaluate(sizes, hardware_for(cfg), pack_size=cfg.pack_size, fwd_micro_batch=cfg.micro_batch_size,
                     bwd_micro_batch=cfg.bwd_micro_batch_size, prefetch_window=cfg.prefetch_window, stash=cfg.stash,
                     gpus=len(cfg.devices), seq=cfg.seq_len, global_batch=cfg.global_batch, precision=cfg.precision,
                     max_grad_norm=cfg.max_grad_norm, host_grad_buffers=cfg.host_grad_buffers,
                     device_optimizer=cfg.device_optimizer or "off", resident_packs=cfg.resident_packs or 0)
        if c.gpu_need > gpu:
            raise PlanDoesNotFitError(
                f"this plan ({c.describe()}) needs {c.gpu_need / GiB:.1f} GiB memory per device for "
                f"{cfg.global_batch} x {cfg.seq_len} tokens, have {gpu / GiB:.1f} GiB; leave the packing knobs "
                "unset to let the planner choose, or lower micro_batch_size / pack_size")
        if c.host_need > host:
            raise PlanDoesNotFitError(
                f"this plan ({c.describe()}) needs {c.host_need / GiB:.1f} GiB host memory, have {host / GiB:.1f} GiB"
                "; stash on the device, or add RAM")
        return cfg, None
    if not have_workload:
        if not any(d.startswith("cuda") for d in config.devices):
            return config.with_default_knobs(), None
        raise ConfigError("the automatic plan needs the workload: set Config(seq_len=..., global_batch=...) "
                          "(or set the plan yourself: pack_size=..., micro_batch_size=...)")
    gpu, host = budgets(config)
    result = plan_for(model.config, hardware_for(config), gpus=len(config.devices), gpu_memory_bytes=gpu,
                      cpu_memory_bytes=host, seq=config.seq_len, global_batch=config.global_batch,
                      precision=config.precision, max_grad_norm=config.max_grad_norm,
                      host_grad_buffers=config.host_grad_buffers, lora=lora_settings_of(model),
                      device_optimizer=config.device_optimizer, resident_packs=config.resident_packs)
    k = result.best.knobs
    pack = k["pack_size"] if isinstance(k["pack_size"], int) else tuple(k["pack_size"])
    stash = k["stash"] if isinstance(k["stash"], str) else tuple(k["stash"])
    cfg = config.replace(pack_size=pack, micro_batch_size=k["micro_batch_size"],
                         backward_micro_batch_size=k["backward_micro_batch_size"],
                         prefetch_window=k["prefetch_window"], stash=stash,
                         device_optimizer=k.get("device_optimizer", "off"), resident_packs=k.get("resident_packs", 0))
    return cfg, result


def lora_settings_of(model: nn.Module):  # -> LoraSettings | None
    """The LoRA settings of a ``peft.PeftModel`` (so the plan sizes its adapters), else None."""
    from tinypipe.lora.hooks import is_peft_model

    if not is_peft_model(model):
        return None
    from tinypipe.lora.settings import LoraSettings

    from tinypipe.errors import TinypipeError
    from tinypipe.planner.sizes import lora_sizes

    try:
        pc = model.peft_config[model.active_adapter]
        targets = pc.target_modules
        targets = [targets] if isinstance(targets, str) else sorted(targets)
        from tinypipe.quant.model import spec_of  # QLoRA: plan the quantized base's sizes

        quant = spec_of(model)
        settings = LoraSettings(rank=int(pc.r), alpha=float(pc.lora_alpha), targets=targets,
                                quantize=quant.scheme if quant is not None else None,
                                double_quant=quant.double_quant if quant is not None else True,
                                compute_dtype="fp32" if quant is not None and quant.unit == 4 else "bf16")
        lora_sizes(model.config, settings)  # adapters the planner cannot size: plan as full fine-tuning
    except (TinypipeError, AttributeError, KeyError, TypeError, ValueError):
        return None
    return settings
