"""The engine plans for itself: when no packing knob is set in :class:`~tinypipe.Config`, choose
them with :func:`~tinypipe.planner.search.plan` on the one request :func:`request_for` builds for
the model, the devices and the memory budgets; refuse to start (one line) when nothing fits. A
hand-set plan is kept as is, and checked against the budgets when the workload (``seq_len``,
``global_batch``) is given.

Budgets: ``Config.gpu_memory_bytes`` or, per CUDA device, its capacity under the per-process
memory cap (``torch.cuda.set_per_process_memory_fraction``), or its free memory plus what this
process already reserved if that is less; on CPU devices the available RAM.
``Config.cpu_memory_bytes`` or the available RAM plus this process's resident memory (the
planner's host need includes the process itself).

``Config.offload_dir``: the host budget becomes a real limit with the SSD as the overflow -- the
automatic plan and a hand-set one alike get the offload set (``Plan.offload``) that fits them into
it, chosen by :func:`~tinypipe.planner.spill.choose_spill` at the hardware's SSD rates (never
measured here: the set depends on the budget, the rates only rank plans).

``Config.assist_updates`` (the default): the automatic plan carries the layers whose AdamW the GPU
steps (``Plan.assisted``, :mod:`tinypipe.planner.assist`) -- with ``max_grad_norm`` their clipped
updates on their way up, without it right after their backward where the host AdamW would hold the
backward up; a hand-set plan is run as set (none).

Data-parallel replicas (``resolve_plan(..., replicas=R)``, for the distributed runtime): the plan of
one replica for ``global_batch / R`` sequences, with ``Plan.replicas`` and
``Plan.optimizer_sharding`` chosen by :mod:`tinypipe.planner.replica_search`; ``replicas=1`` (the
default) is the single-engine path above, unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from tinypipe.config import Config
from tinypipe.errors import ConfigError, PlanDoesNotFitError, TinypipeError, UnsupportedModelError
from tinypipe.models.chunked_mlp import mlp_chunk_tokens_for
from tinypipe.planner.hardware import HARDWARE, HardwareSpec, load_hardware
from tinypipe.planner.sizes import dtype_bytes
from tinypipe.schedule.plan import Plan, make_plan

if TYPE_CHECKING:
    from tinypipe.planner.request import PlanRequest
    from tinypipe.planner.search import PlanResult

GiB = 1024**3
#: Rates for CPU "devices" (only the ranking of plans matters there).
CPU_HARDWARE = HardwareSpec("cpu", 0, 10.0, 10.0, 10.0, 0.2, 0.5, fp32_tflops=0.2,
                            description="CPU devices (tests): host memory is device memory",
                            ssd_read_gbps=2.0, ssd_write_gbps=2.0, device_kind="cpu")
#: GPU name fragment -> hardware preset, for the time model when Config.hardware is not given.
_NAME_TO_PRESET = (("h200", "h200-pcie5"), ("h100", "h200-pcie5"), ("4090", "rtx4090-pcie4"),
                   ("3090", "rtx3090-pcie4"), ("a5000", "a5000"), ("l40s", "l40s"),
                   ("a100", "a100-40g-pcie4"))


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


def entries_per_gpu(devices: list[str]) -> int:
    """The most device entries that name one CUDA device (``cuda:0,cuda:0``: two pipeline stages
    on one GPU): they share its memory, its compute and its host link."""
    counts: dict[str, int] = {}
    for d in devices:
        if d.startswith("cuda"):
            key = d if ":" in d else "cuda:0"
            counts[key] = counts.get(key, 0) + 1
    return max(counts.values(), default=1)


def budgets(cfg: Config) -> tuple[int, int]:
    """(GPU bytes per device entry, host bytes) the plan must fit. Entries that share one GPU
    split its budget (the estimator sizes each entry on its own)."""
    avail, rss = _available_ram()
    gpu = cfg.gpu_memory_bytes
    if gpu is None:
        cuda = [d for d in cfg.devices if d.startswith("cuda")]
        gpu = min(_cuda_capacity(d) for d in sorted(set(cuda))) if cuda else avail
    host = cfg.cpu_memory_bytes if cfg.cpu_memory_bytes is not None else avail + rss
    return int(gpu) // entries_per_gpu(list(cfg.devices)), int(host)


def hardware_for(cfg: Config) -> HardwareSpec:
    """The hardware the planner times ``cfg``'s devices on: a preset (or profile) per GPU, each
    entry's share of it where several entries name one GPU (its compute rates and link split)."""
    hw = _hardware(cfg)
    if not any(d.startswith("cuda") for d in cfg.devices) and hw.device_kind != "cpu":
        hw = dataclasses.replace(hw, device_kind="cpu")  # a GPU's rates, timed for CPU entries' memory
    shared = entries_per_gpu(list(cfg.devices))
    return hw if shared == 1 else hw.shared_by(shared)


def _hardware(cfg: Config) -> HardwareSpec:
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


def manual_plan(config: Config, *, num_blocks: int, tied: bool, keep_streamed: bool = True) -> Plan:
    """The plan the hand-set knobs of ``config`` describe (unset ones at their defaults);
    ``keep_streamed`` False (a QLoRA base): ``keep_activations=True`` keeps fixed-slot packs only."""
    return make_plan(num_blocks, num_devices=len(config.devices), tied=tied, keep_streamed=keep_streamed,
                     **config.plan_settings())


def resolve_plan(model: nn.Module, config: Config, *, num_blocks: int, tied: bool,
                 plan: Plan | None = None, replicas: int = 1, replicas_per_node: int | None = None,
                 links_gbs: tuple[float, float] | None = None) -> tuple[Plan, PlanResult | None]:
    """The plan the engine runs and the planner's result (None unless the planner chose the plan).

    ``plan`` given: that plan. No packing knob set in ``config``: the planner's plan for the
    workload and the budgets. Otherwise the plan of the hand-set knobs, checked against the
    budgets when the workload is given. Raises :class:`PlanDoesNotFitError` when no plan -- or
    the hand-set one -- fits, ConfigError when the plan does not suit the model or the devices.

    ``replicas > 1`` (the distributed runtime: this engine is one of R data-parallel replicas,
    ``replicas_per_node`` of them per node -- default all -- linked at ``links_gbs`` (within a node,
    between nodes)): the plan of one replica for ``global_batch / replicas`` sequences with
    ``Plan.replicas`` and ``Plan.optimizer_sharding`` filled in (:func:`_resolve_replicas`)."""
    result = None
    if replicas != 1:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ConfigError(f"replicas must be a positive integer, got {replicas!r}")
        plan, result = _resolve_replicas(model, config, num_blocks=num_blocks, tied=tied, plan=plan,
                                        replicas=replicas, replicas_per_node=replicas_per_node or replicas,
                                        links_gbs=links_gbs)
    elif plan is None:
        plan, result = _choose(model, config, num_blocks=num_blocks, tied=tied)
    if plan.num_devices != len(config.devices):
        raise ConfigError(f"plan is for {plan.num_devices} devices, config lists {len(config.devices)}")
    if plan.num_blocks != num_blocks:
        raise ConfigError(f"plan covers {plan.num_blocks} blocks, the model has {num_blocks}")
    return plan, result


def _resolve_replicas(model: nn.Module, config: Config, *, num_blocks: int, tied: bool, plan: Plan | None,
                     replicas: int, replicas_per_node: int,
                     links_gbs: tuple[float, float] | None) -> tuple[Plan, PlanResult | None]:
    """One of R data-parallel replicas (the distributed runtime calls :func:`resolve_plan` with the
    replica count): the plan of one replica for 1/R of the global batch, with ``Plan.replicas`` and
    ``Plan.optimizer_sharding`` filled in, and the planner's result (None unless it chose the plan).

    ``Config.optimizer_sharding="auto"``: replicate when it fits the node's host memory and is not
    slower, shard otherwise (:func:`~tinypipe.planner.replicas.choose_sharding`); a forced value is
    kept, and refused (one line) when the automatic plan cannot fit it. The host budget
    (``Config.cpu_memory_bytes`` or the available RAM) is the node's, shared by ``replicas_per_node``
    replica processes; the GPU budget is per device, as for one replica. ``links_gbs`` (within a
    node, between nodes, GB/s) times the collectives (default: the hardware's PCIe generation
    within, the ``eth25`` preset between -- a slow network; pass the real one).

    Every rank must reach the same plan: ranks on different nodes see different available RAM, so
    the runtime should pass one budget (``Config.cpu_memory_bytes``) or compare plans across ranks."""
    from tinypipe.planner.hardware import interconnect_gbs, node_link_for
    from tinypipe.planner.replica_search import plan_layout, weigh_plan
    from tinypipe.planner.replicas import Cluster, Layout, split_batch
    from tinypipe.planner.spill import ssd_tier_on

    if replicas_per_node < 1 or replicas % replicas_per_node:
        raise ConfigError(f"{replicas} replicas do not spread evenly over nodes of {replicas_per_node}")
    if ssd_tier_on(config):
        raise ConfigError("the SSD tier (offload_dir) is not planned for data-parallel replicas yet")
    if config.global_batch is not None:
        split_batch(config.global_batch, replicas)  # refuse an uneven split (one line) before planning
    hw = hardware_for(config)
    intra, inter = links_gbs or (interconnect_gbs(node_link_for(hw)), interconnect_gbs("eth25"))
    gpu, host = budgets(config)
    devices = len(config.devices)
    cluster = Cluster(replicas // replicas_per_node, replicas_per_node * devices, intra, inter, host)
    layout = Layout(replicas, devices, replicas_per_node)
    given = plan is not None
    have_workload = config.seq_len is not None and config.global_batch is not None
    cuda = any(d.startswith("cuda") for d in config.devices)
    backend = not cuda or torch.cuda.is_available()  # else the device backend reports it, in its words
    planned = config.auto_plan and plan is None and have_workload and backend
    if planned:
        assert config.seq_len is not None and config.global_batch is not None
        lp = plan_layout(model.config, hw, cluster, layout, seq=config.seq_len,
                         global_batch=config.global_batch, sharding=config.optimizer_sharding,
                         gpu_memory_bytes=gpu, precision=config.precision,
                         max_grad_norm=config.max_grad_norm, host_grad_buffers=config.host_grad_buffers,
                         lora=lora_settings_of(model), device_optimizer=config.device_optimizer,
                         resident_packs=config.resident_packs, mlp_chunk_tokens=config.mlp_chunk_tokens,
                         document_tokens=config.document_tokens,
                         attention_tile_tokens=config.attention_tile_tokens)
        if not lp.fits:
            raise PlanDoesNotFitError(f"{layout.describe()} replicas: {lp.reason}")
        chosen = lp.plan()
        if config.grad_slots is not None:  # a runtime setting the planner leaves alone
            chosen = dataclasses.replace(chosen, grad_slots=config.grad_slots)
        assert lp.choice is not None
        return chosen, lp.choice.result
    per_replica = config if config.global_batch is None else config.replace(
        global_batch=config.global_batch // replicas)
    if plan is None:
        plan, _ = resolve_plan(model, per_replica, num_blocks=num_blocks, tied=tied)
    sizes = _sizes_of(model, config)
    lp = weigh_plan(sizes, hw, cluster, layout, plan, seq=config.seq_len,
                    global_batch=config.global_batch, sharding=config.optimizer_sharding,
                    precision=config.precision, max_grad_norm=config.max_grad_norm,
                    host_grad_buffers=config.host_grad_buffers,
                    mlp_chunk=mlp_chunk_tokens_for(config.mlp_chunk_tokens, sizes.intermediate,
                                                   dtype_bytes(config.precision), config.seq_len))
    if lp.choice is None:
        if given or not have_workload:  # a plan passed in, or nothing to check it with: the leanest
            lean = "shard" if config.optimizer_sharding != "replicate" else "replicate"
            return dataclasses.replace(plan, replicas=replicas, optimizer_sharding=lean), None
        raise PlanDoesNotFitError(f"this plan ({plan.describe()}) as {layout.describe()} replicas: "
                                  f"{lp.reason}")
    return lp.plan(), None


def _choose(model: nn.Module, config: Config, *, num_blocks: int,
            tied: bool) -> tuple[Plan, PlanResult | None]:
    """The hand-set knobs' plan (checked when the workload is given), or the planner's."""
    from tinypipe.planner.spill import ssd_tier_on

    have_workload = config.seq_len is not None and config.global_batch is not None
    cuda = any(d.startswith("cuda") for d in config.devices)
    streamed = not quantized_base(model)
    if cuda and not torch.cuda.is_available():  # the device backend reports it, in its words
        return manual_plan(config, num_blocks=num_blocks, tied=tied, keep_streamed=streamed), None
    if not config.auto_plan:
        own = manual_plan(config, num_blocks=num_blocks, tied=tied, keep_streamed=streamed)
        if have_workload:
            own = _check_fits(model, config, own)
        elif ssd_tier_on(config):
            own = _offload_without_workload(model, config, own)
        return own, None
    if not have_workload:
        if not cuda:
            own = manual_plan(config, num_blocks=num_blocks, tied=tied, keep_streamed=streamed)
            if ssd_tier_on(config):
                own = _offload_without_workload(model, config, own)
            return own, None
        raise ConfigError("the automatic plan needs the workload: set Config(seq_len=..., global_batch=...) "
                          "(or set the plan yourself: pack_size=..., micro_batch_size=...)")
    result = _search(model, config)
    chosen = result.best.plan
    if config.grad_slots is not None:  # a runtime setting the planner leaves alone
        chosen = dataclasses.replace(chosen, grad_slots=config.grad_slots)
    return chosen, result


def _search(model: nn.Module, config: Config) -> PlanResult:
    """The planner's answer for ``model`` on ``config``'s devices, budgets and workload."""
    from tinypipe.planner.search import plan

    hw = hardware_for(config)
    return plan(request_for(config, model, hw), hw)


def request_for(config: Config, model: nn.Module, hw: HardwareSpec) -> PlanRequest:
    """The one planning request the engine makes for ``model`` on ``config`` timed on ``hw``
    (:func:`hardware_for`): the workload and budgets (:func:`budgets`), precision and clipping, the
    adapters as the loader attached them (:func:`lora_settings_of`: unreadable ones are an error,
    never a full fine-tuning plan), the SSD of ``offload_dir`` and the knobs ``config`` fixes."""
    from tinypipe.planner.request import PlanRequest
    from tinypipe.planner.spill import ssd_for

    assert config.seq_len is not None and config.global_batch is not None  # the caller checked
    gpu, host = budgets(config)
    return PlanRequest(model_config=model.config, gpus=len(config.devices), gpu_memory_bytes=gpu or None,
                       cpu_memory_bytes=host, seq=config.seq_len, global_batch=config.global_batch,
                       precision=config.precision, max_grad_norm=config.max_grad_norm,
                       host_grad_buffers=config.host_grad_buffers, lora=lora_settings_of(model),
                       device_optimizer=config.device_optimizer, resident_packs=config.resident_packs,
                       ssd=ssd_for(config, hw), keep_activations=config.keep_activations,
                       assist_updates=config.assist_updates, turn_packs=config.turn_packs,
                       mlp_chunk_tokens=config.mlp_chunk_tokens, document_tokens=config.document_tokens,
                       attention_tile_tokens=config.attention_tile_tokens)


def quantized_base(model: nn.Module) -> bool:
    """Whether ``model`` holds bitsandbytes modules (a QLoRA base): their kernels keep the packed
    weight on their autograd context, outside saved-tensor hooks, so a streamed pack cannot keep
    its graph (:meth:`Plan.keepable_packs`)."""
    from tinypipe.quant.model import quantized_modules

    return next(quantized_modules(model), None) is not None


def check_keepable(plan: Plan, model: nn.Module) -> None:
    """ConfigError when ``plan`` keeps a streamed pack's graph over a QLoRA base."""
    kept = {q for q in range(plan.num_packs) if plan.kept(q)}
    streamed = sorted(kept - set(plan.fixed_slot_packs()))
    if streamed and quantized_base(model):
        raise ConfigError(f"plan keeps the activations of streamed pack {streamed[0]} over a quantized base: "
                          "bitsandbytes keeps its 4-bit weights outside the saved tensors a streamed pack "
                          "re-reads; keep only resident packs and the last pack")


def _sizes_of(model: nn.Module, config: Config | None = None):  # -> ModelSizes
    """The model's sizes, with ``config``'s attention tile where it sets one."""
    from tinypipe.planner.sizes import lora_sizes, model_sizes

    lora = lora_settings_of(model)
    sizes = lora_sizes(model.config, lora) if lora is not None else model_sizes(model.config)
    if config is not None and config.attention_tile_tokens is not None:
        sizes = dataclasses.replace(sizes, attention_tile=config.attention_tile_tokens)
    return sizes


def _offload_without_workload(model: nn.Module, config: Config, plan: Plan) -> Plan:
    """A hand-set plan without a workload, with ``offload_dir``: the offload set that fits the host
    budget, counting no stashed activations (their size needs the workload)."""
    from tinypipe.planner.candidate import HOST_BASELINE_BYTES
    from tinypipe.planner.estimate import cpu_pool_bytes, host_bytes
    from tinypipe.planner.spill import choose_spill

    _, host = budgets(config)
    sizes = _sizes_of(model)
    retain = config.max_grad_norm is not None
    cats = host_bytes(sizes, plan, batch=0, seq=0, precision=config.precision,
                      num_devices=len(config.devices),
                      host_grad_buffers=config.host_grad_buffers, retain_grads=retain)
    # (no workload: no activations; CPU entries' pools stay beside what an offload moves)
    beside = HOST_BASELINE_BYTES + cpu_pool_bytes(sizes, plan, config.devices, config.precision)
    offload, need = choose_spill(sizes, plan, cats, beside, host, precision=config.precision,
                                 retain_grads=retain)
    if offload is None:
        raise PlanDoesNotFitError(
            f"this plan ({plan.describe()}) needs {need / GiB:.1f} GiB host memory even with its training "
            f"state on the SSD, have {host / GiB:.1f} GiB; add RAM or use LoRA")
    return dataclasses.replace(plan, offload=offload)


def _check_fits(model: nn.Module, config: Config, plan: Plan) -> Plan:
    """``plan`` -- with ``offload_dir``, with the state on the SSD that fits it into the host
    budget; raise :class:`PlanDoesNotFitError` (one line) when it needs more device or host memory
    than the budgets hold for the workload."""
    from tinypipe.planner.search import evaluate
    from tinypipe.planner.spill import Spill, ssd_for

    gpu, host = budgets(config)
    sizes = _sizes_of(model, config)
    hw = hardware_for(config)
    ssd = ssd_for(config, hw)
    if ssd is not None:
        hw = ssd.apply(hw)
    mlp_chunk = mlp_chunk_tokens_for(config.mlp_chunk_tokens, sizes.intermediate,
                                     dtype_bytes(config.precision), config.seq_len)

    def ev(p: Plan, peaks=None):  # -> Candidate
        return evaluate(sizes, hw, p, seq=config.seq_len, global_batch=config.global_batch,
                        precision=config.precision, max_grad_norm=config.max_grad_norm,
                        host_grad_buffers=config.host_grad_buffers, peaks=peaks, mlp_chunk=mlp_chunk)

    c = ev(plan)
    if c.gpu_need > gpu:
        raise PlanDoesNotFitError(
            f"this plan ({plan.describe()}) needs {c.gpu_need / GiB:.1f} GiB memory per device for "
            f"{config.global_batch} x {config.seq_len} tokens, have {gpu / GiB:.1f} GiB; leave the packing "
            "knobs unset to let the planner choose, or lower micro_batch_size / pack_size")
    if c.host_need <= host:
        return plan
    spill = Spill(sizes, ssd, host, precision=config.precision, retain_grads=config.max_grad_norm is not None,
                  mlp_chunk=mlp_chunk)
    settled = spill.settle(c, ev)
    if settled is not None:
        return settled.plan
    if ssd is not None:
        raise PlanDoesNotFitError(f"this plan ({plan.describe()}) {spill.why_not()}")
    raise PlanDoesNotFitError(
        f"this plan ({plan.describe()}) needs {c.host_need / GiB:.1f} GiB host memory, have "
        f"{host / GiB:.1f} GiB; stash on the device, or add RAM")


def lora_settings_of(model: nn.Module):  # -> LoraSettings | None
    """The LoRA settings of a ``peft.PeftModel`` (so the plan sizes its adapters), else None.

    Read from the adapters the model really has (the PEFT config's ``target_modules`` may be a
    regular expression or ``"all-linear"``). A model whose adapters the planner cannot size is an
    error naming why, never a plan sized as full fine-tuning: that plan would budget gradients and
    optimizer state for the frozen base and hide the mistake."""
    from tinypipe.lora.hooks import is_peft_model

    if not is_peft_model(model):
        return None
    from tinypipe.lora.settings import LoraSettings
    from tinypipe.planner.sizes import lora_sizes
    from tinypipe.quant.model import spec_of  # QLoRA: plan the quantized base's sizes

    def refuse(why: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"cannot plan for this PEFT model's adapters: {why}; give the plan "
                                     "yourself (Config's plan knobs) or attach adapters with tinypipe's "
                                     "LoRA options")

    active = getattr(model, "active_adapter", None)
    pc = getattr(model, "peft_config", {}).get(active) if isinstance(active, str) else None
    kind = getattr(pc, "peft_type", None) if pc is not None else None
    if kind is None or str(getattr(kind, "value", kind)) != "LORA":
        raise refuse(f"the active adapter {active!r} is not a LoRA adapter")
    adapted = {name.rsplit(".", 1)[-1]: module for name, module in model.named_modules()
               if active in getattr(module, "lora_A", {})}
    if not adapted:
        raise refuse("no module carries the active adapter")
    ranks = {int(m.r[active]) for m in adapted.values()}
    if len(ranks) != 1 or getattr(pc, "use_dora", False):
        raise refuse("adapters of several ranks (rank_pattern)" if len(ranks) != 1 else "DoRA adapters")
    quant = spec_of(model)
    try:
        settings = LoraSettings(rank=ranks.pop(), alpha=float(pc.lora_alpha), targets=sorted(adapted),
                                dropout=float(pc.lora_dropout),
                                quantize=quant.scheme if quant is not None else None,
                                double_quant=quant.double_quant if quant is not None else True,
                                compute_dtype="fp32" if quant is not None and quant.unit == 4 else "bf16")
        lora_sizes(model.config, settings)
    except (TinypipeError, AttributeError, KeyError, TypeError, ValueError) as exc:
        raise refuse(f"{type(exc).__name__}: {exc}") from exc
    return settings
