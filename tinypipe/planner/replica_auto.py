"""The engine's plan when it is one of R data-parallel replicas (``resolve_plan(..., replicas=R)``,
called by the distributed runtime with the replica count): the per-replica plan for 1/R of the
global batch, with ``Plan.replicas`` and ``Plan.optimizer_sharding`` filled in.

``Config.optimizer_sharding="auto"``: replicate when it fits the node's host memory and is not
slower, shard otherwise (:func:`~tinypipe.planner.replicas.choose_sharding`); a forced value is
kept, and refused (one line) when the automatic plan cannot fit it. The host budget
(``Config.cpu_memory_bytes`` or the available RAM) is the node's, shared by ``replicas_per_node``
replica processes; the GPU budget is per device, as for one replica. ``links_gbs`` (within a node,
between nodes, GB/s) times the collectives (default: the hardware's PCIe generation within, the
``eth25`` preset between -- a slow network; pass the real one).

Every rank must reach the same plan: ranks on different nodes see different available RAM, so the
runtime should pass one budget (``Config.cpu_memory_bytes``) or compare the plans across ranks.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from tinypipe.config import Config
from tinypipe.errors import ConfigError, PlanDoesNotFitError
from tinypipe.planner.hardware import interconnect_gbs, node_link_for
from tinypipe.planner.replicas import Cluster, Layout, split_batch
from tinypipe.schedule.plan import Plan

if TYPE_CHECKING:
    from tinypipe.planner.search import PlanResult


def resolve_replicas(model: nn.Module, config: Config, *, num_blocks: int, tied: bool, plan: Plan | None,
                     replicas: int, replicas_per_node: int,
                     links_gbs: tuple[float, float] | None) -> tuple[Plan, PlanResult | None]:
    """One replica's plan and the planner's result (None unless the planner chose the plan)."""
    from tinypipe.planner import auto
    from tinypipe.planner.replica_search import plan_layout, weigh_plan

    if replicas_per_node < 1 or replicas % replicas_per_node:
        raise ConfigError(f"{replicas} replicas do not spread evenly over nodes of {replicas_per_node}")
    if config.offload_dir is not None:
        raise ConfigError("the SSD tier (offload_dir) is not planned for data-parallel replicas yet")
    if config.global_batch is not None:
        split_batch(config.global_batch, replicas)  # refuse an uneven split (one line) before planning
    hw = auto.hardware_for(config)
    intra, inter = links_gbs or (interconnect_gbs(node_link_for(hw)), interconnect_gbs("eth25"))
    gpu, host = auto.budgets(config)
    devices = len(config.devices)
    cluster = Cluster(replicas // replicas_per_node, replicas_per_node * devices, intra, inter, host)
    layout = Layout(replicas, devices, replicas_per_node)
    given = plan is not None
    have_workload = config.seq_len is not None and config.global_batch is not None
    cuda = any(d.startswith("cuda") for d in config.devices)
    planned = config.auto_plan and plan is None and have_workload and not (cuda and not torch.cuda.is_available())
    if planned:
        lp = plan_layout(model.config, hw, cluster, layout, seq=config.seq_len,  # type: ignore[arg-type]
                         global_batch=config.global_batch, sharding=config.optimizer_sharding,  # type: ignore[arg-type]
                         gpu_memory_bytes=gpu, precision=config.precision,
                         max_grad_norm=config.max_grad_norm, host_grad_buffers=config.host_grad_buffers,
                         lora=auto.lora_settings_of(model), device_optimizer=config.device_optimizer,
                         resident_packs=config.resident_packs)
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
        plan, _ = auto.resolve_plan(model, per_replica, num_blocks=num_blocks, tied=tied)
    lp = weigh_plan(auto._sizes_of(model), hw, cluster, layout, plan, seq=config.seq_len,
                    global_batch=config.global_batch, sharding=config.optimizer_sharding,
                    precision=config.precision, max_grad_norm=config.max_grad_norm,
                    host_grad_buffers=config.host_grad_buffers)
    if lp.choice is None:
        if given or not have_workload:  # a plan passed in, or nothing to check it with: the leanest
            lean = "shard" if config.optimizer_sharding != "replicate" else "replicate"
            return dataclasses.replace(plan, replicas=replicas, optimizer_sharding=lean), None
        raise PlanDoesNotFitError(f"this plan ({plan.describe()}) as {layout.describe()} replicas: {lp.reason}")
    return lp.plan(), None
