"""Plans for data-parallel layouts: for each way to cut N x P GPUs into R replicas of G GPUs, the
fastest per-replica plan (:func:`~tinypipe.planner.search.plan` on G GPUs and 1/R of the batch)
under each optimizer sharding, its host memory per node and step time
(:mod:`tinypipe.planner.replicas`), the sharding chosen, and the fastest layout that fits.

The per-replica search sees what one replica gets: the node's host budget divided by the replicas
on the node, against which (sharded) each plan's host need is counted as one rank holds it --
a host-stepped layer's moments and retained gradient 1/R, a layer stepped on its device (a
resident pack, the embedding or head) whole (:func:`~tinypipe.planner.sharded_host.sharded_candidate`)
-- and the node's CPU AdamW rate shared by them
(:func:`~tinypipe.planner.replicas.replica_hardware`). (Adding to the budget what sharding would
save if every layer were host-stepped overstated it by 8 (1 - 1/R) B per device-stepped element:
plans with resident packs looked as if they fit and then did not.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import transformers

from tinypipe.errors import ConfigError, PlanDoesNotFitError
from tinypipe.planner.candidate import evaluate
from tinypipe.planner.estimate import host_bytes
from tinypipe.planner.hardware import HardwareSpec, load_hardware
from tinypipe.planner.presets import load_model_config
from tinypipe.planner.replicas import (
    Cluster,
    Layout,
    LayoutPlan,
    ShardingChoice,
    ShardingOption,
    choose_sharding,
    host_per_node,
    layouts,
    replica_hardware,
    split_batch,
    time_option,
)
from tinypipe.planner.request import PlanRequest
from tinypipe.planner.search import PlanResult, plan
from tinypipe.planner.sharded_host import shard_numel, sharded_host
from tinypipe.planner.sizes import ModelSizes, lora_sizes, model_sizes
from tinypipe.schedule.plan import Plan
from tinypipe.units import gib_pair, gib_text

if TYPE_CHECKING:
    from tinypipe.lora.settings import LoraSettings

#: Layouts within this fraction of the fastest count as equally fast; the one with the least host
#: memory per node is chosen.
NEAR_FASTEST = 0.01


@dataclass
class LayoutComparison:
    """Every layout weighed and the fastest that fits (None: none fits)."""

    cluster: Cluster
    hardware: HardwareSpec
    rows: list[LayoutPlan]
    best: LayoutPlan | None
    seq: int
    global_batch: int
    model_name: str = ""


def plan_layout(config: transformers.PretrainedConfig | str, hardware: HardwareSpec | str,
                cluster: Cluster, layout: Layout, *, seq: int, global_batch: int,
                sharding: ShardingChoice = "auto", gpu_memory_bytes: int | None = None,
                **search: object) -> LayoutPlan:
    """``layout``'s per-replica plan under each sharding ``sharding`` allows, and the one chosen.
    ``search``: the rest of the :class:`PlanRequest` fields (precision, max_grad_norm, lora, ...).
    A global batch the replicas do not divide gives a refused row (``refused``: the line why)."""
    hw = load_hardware(hardware)
    try:
        batch = split_batch(global_batch, layout.replicas)
    except ConfigError as exc:
        return LayoutPlan(layout, {}, None, str(exc), refused=str(exc))
    if sharding not in ("auto", "replicate", "shard"):
        raise ConfigError(f"optimizer sharding must be auto, replicate or shard, got {sharding!r}")
    names = ["replicate"] if layout.replicas == 1 else (
        ["replicate", "shard"] if sharding == "auto" else [sharding])
    cfg = config if isinstance(config, transformers.PretrainedConfig) else load_model_config(str(config))
    lora: LoraSettings | None = search.get("lora")  # type: ignore[assignment]
    sizes = lora_sizes(cfg, lora) if lora is not None else model_sizes(cfg)
    budget = cluster.host_bytes_per_node
    options: dict[str, ShardingOption] = {}
    for name in names:
        opt = ShardingOption(name)  # type: ignore[arg-type]  # a name from OPTIMIZER_SHARDINGS
        options[name] = opt
        saved = 0 if name == "replicate" else sum(
            8 * (n - shard_numel(n, layout.replicas)) for n in sizes.layer_train_numels)
        held = "replicated" if name == "replicate" else "sharded"
        floor = host_per_node({"state": 12 * sizes.train_total - saved}, layout.per_node)
        if floor > budget:  # masters and moments (or their shards) alone: no plan can fit
            per = "4 + 8" if name == "replicate" else f"4 + 8/{layout.replicas}"
            opt.why_not = (f"{held}: needs at least {gib_text(floor)} host per node ({layout.per_node} x "
                           f"({per}) B/param + the process), have {gib_text(budget)}")
            continue
        # replicas assist no clipped update (Plan.assisted is for one pipeline)
        kw = dict(search, assist_updates=layout.replicas == 1 and bool(search.get("assist_updates", True)))
        try:
            request = PlanRequest(model_config=cfg, gpus=layout.gpus_per_replica,
                                  gpu_memory_bytes=gpu_memory_bytes or None,
                                  cpu_memory_bytes=budget // layout.per_node,
                                  host_shards=1 if name == "replicate" else layout.replicas,
                                  seq=seq, global_batch=batch, **kw)  # type: ignore[arg-type]
            result = plan(request, replica_hardware(hw, layout, opt.sharding))
        except PlanDoesNotFitError as exc:
            opt.why_not = f"{held}: one replica {' '.join(str(exc).split())}"
            continue
        c = result.best
        opt.result, opt.plan = result, c.plan
        opt.host = dict(c.memory.host)  # one rank's bytes (sharded: as the search counted them)
        opt.host_per_node = host_per_node(opt.host, layout.per_node)
        if opt.host_per_node > budget:
            opt.why_not = (f"{held}: needs {gib_text(opt.host_per_node)} host per node, have "
                           f"{gib_text(budget)}")
        time_option(opt, sizes, c.plan, c.time.step_s, c.time.backward_s, layout, cluster,
                    global_batch * seq)
    rep, sh = options.get("replicate"), options.get("shard")
    if rep is not None and sh is not None and not rep.host_per_node and sh.result is not None:
        # the replicated search found nothing: say what the sharded plan would need replicated
        rep.host_per_node = host_per_node(
            _replicated_host(sizes, sh.result, search.get("host_grad_buffers")),  # type: ignore[arg-type]
            layout.per_node)
    choice, reason = choose_sharding(options, budget, layout.replicas)
    return LayoutPlan(layout, options, choice, reason)


def _replicated_host(sizes: ModelSizes, result: PlanResult, host_grad_buffers: int | None) -> dict[str, int]:
    """The host bytes the best plan of a sharded search would need with its state replicated."""
    plan = result.best.plan
    return host_bytes(sizes, plan, batch=result.global_batch, seq=result.seq, precision=result.precision,
                      num_devices=plan.num_devices, host_grad_buffers=host_grad_buffers,
                      retain_grads=result.retain_grads, mlp_chunk=result.mlp_chunk_tokens)


def weigh_plan(sizes: ModelSizes, hardware: HardwareSpec, cluster: Cluster, layout: Layout, plan: Plan, *,
               seq: int | None, global_batch: int | None, sharding: ShardingChoice = "auto",
               precision: str = "bf16", max_grad_norm: float | None = None,
               host_grad_buffers: int | None = None, mlp_chunk: int = 0) -> LayoutPlan:
    """A fixed per-replica ``plan`` (given or hand-set) under each sharding ``sharding`` allows, and
    the one chosen. Without the workload (``seq`` / ``global_batch``) only host memory decides:
    replicate when it fits (stashed activations not counted), shard otherwise. ``mlp_chunk``: the
    token chunk the blocks' MLPs run in at this workload (0: unchunked), as the engine runs them:
    long sequences stash more in host memory (the embedding's output) and recompute more."""
    workload = seq is not None and global_batch is not None
    batch = split_batch(global_batch, layout.replicas) if global_batch is not None else None
    names = ["replicate"] if layout.replicas == 1 else (
        ["replicate", "shard"] if sharding == "auto" else [sharding])
    retain = max_grad_norm is not None
    budget = cluster.host_bytes_per_node
    options: dict[str, ShardingOption] = {}
    for name in names:
        opt = ShardingOption(name, plan=plan)  # type: ignore[arg-type]
        options[name] = opt
        if workload:
            assert seq is not None and batch is not None
            c = evaluate(sizes, replica_hardware(hardware, layout, opt.sharding), plan, seq=seq,
                         global_batch=batch, precision=precision,  # type: ignore[arg-type]
                         max_grad_norm=max_grad_norm, host_grad_buffers=host_grad_buffers,
                         mlp_chunk=mlp_chunk)
            host = dict(c.memory.host)
        else:
            host = host_bytes(sizes, plan, batch=0, seq=0, precision=precision, num_devices=plan.num_devices,
                              host_grad_buffers=host_grad_buffers, retain_grads=retain)
        opt.host = host if name == "replicate" else sharded_host(host, sizes, plan, layout.replicas, retain)
        opt.host_per_node = host_per_node(opt.host, layout.per_node)
        if opt.host_per_node > budget:
            need, have = gib_pair(opt.host_per_node, budget)
            opt.why_not = f"needs {need} host per node, have {have}"
        if workload:
            time_option(opt, sizes, plan, c.time.step_s, c.time.backward_s, layout, cluster,
                        global_batch * seq)  # type: ignore[operator]
    if workload:
        choice, reason = choose_sharding(options, budget, layout.replicas)
        return LayoutPlan(layout, options, choice, reason)
    rep, sh = options.get("replicate"), options.get("shard")
    if rep is not None and (rep.fits or sh is None):
        why = (f"replicate: fits the host ({gib_text(rep.host_per_node)} of {gib_text(budget)} per node; "
               "no workload given, so host memory alone decides)" if rep.fits else rep.why_not)
        return LayoutPlan(layout, options, rep if rep.fits else None, why)
    assert sh is not None
    return LayoutPlan(layout, options, sh if sh.fits else None,
                      (f"shard: replicated state needs {gib_text(rep.host_per_node)} host per node, have "
                       f"{gib_text(budget)} (no workload given: host memory alone decides)" if rep is not None
                       else f"shard (as asked): {gib_text(sh.host_per_node)} host per node")
                      if sh.fits else sh.why_not)


def compare_layouts(config: transformers.PretrainedConfig | str, hardware: HardwareSpec | str,
                    cluster: Cluster, *, seq: int, global_batch: int, gpus_per_replica: int | None = None,
                    sharding: ShardingChoice = "auto", gpu_memory_bytes: int | None = None,
                    **search: object) -> LayoutComparison:
    """Every layout of ``cluster`` (or only ``gpus_per_replica``), each planned, and the fastest that
    fits (ties within :data:`NEAR_FASTEST`: the least host per node). Raises PlanDoesNotFitError
    (one line per layout) when none fits, ConfigError when the only layout asked for is refused."""
    hw = load_hardware(hardware)
    cfg = config if isinstance(config, transformers.PretrainedConfig) else load_model_config(str(config))
    name = config if isinstance(config, str) else getattr(cfg, "name_or_path", "")
    rows = [plan_layout(cfg, hw, cluster, lay, seq=seq, global_batch=global_batch, sharding=sharding,
                        gpu_memory_bytes=gpu_memory_bytes, **search)
            for lay in layouts(cluster, gpus_per_replica)]
    if len(rows) == 1 and rows[0].refused:
        raise ConfigError(rows[0].refused)
    fitting = [r for r in rows if r.fits]
    if not fitting:
        raise PlanDoesNotFitError("no layout fits: " + "; ".join(
            f"{r.layout.describe()}: {r.reason}" for r in rows))
    fastest = max(r.tokens_per_s for r in fitting)
    near = [r for r in fitting if r.tokens_per_s >= fastest * (1 - NEAR_FASTEST)]
    best = min(near, key=lambda r: (r.choice.host_per_node if r.choice else 0, -r.tokens_per_s))
    return LayoutComparison(cluster, hw, rows, best, seq, global_batch, model_name=str(name))
