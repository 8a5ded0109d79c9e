"""``tinypipe plan --nodes N --gpus P``'s text: one row per layout (R replicas x G GPUs each:
predicted tokens/s, the GPU peak, host memory per node, the optimizer sharding), the layout chosen
and why its sharding, and the chosen per-replica plan in full (:func:`format_plan`)."""

from __future__ import annotations

import dataclasses
import textwrap

from tinypipe.memory.report import MemoryReport
from tinypipe.planner.candidate import HOST_BASELINE_BYTES
from tinypipe.planner.format import format_plan
from tinypipe.planner.replica_search import LayoutComparison
from tinypipe.planner.replicas import LayoutPlan
from tinypipe.planner.search import PlanResult
from tinypipe.units import gib_text


def _link(gbs: float) -> str:
    return f"{gbs:.3g} GB/s"


def _row(r: LayoutPlan, best: LayoutPlan | None, nodes: int) -> str:
    mark = "*" if r is best else " "
    where = f", {r.layout.nodes} node" if r.layout.nodes < nodes else ""
    name = f"{r.layout.describe()} ({r.layout.kind}{where})"
    if r.refused:
        return f" {mark} {name:<31} refused: {r.refused}"
    c = r.choice
    if c is None or not c.fits or c.result is None:
        return f" {mark} {name:<31} does not fit: {r.reason}"
    comm = c.exposed_s + c.allgather_s
    return (f" {mark} {name:<31} {c.tokens_per_s:>10,.0f} {c.step_s:>7.2f} {comm:>8.2f} "
            f"{gib_text(c.result.best.gpu_need):>9} {gib_text(c.host_per_node):>10}  {c.sharding}")


def _wrapped(text: str, width: int = 110) -> list[str]:
    return textwrap.wrap(text, width=width, subsequent_indent="  ", break_on_hyphens=False)


def format_comparison(cmp: LayoutComparison, detail: bool = True) -> str:
    """The layouts' table, the choice and (``detail``) the chosen replica's full plan."""
    cl, hw = cmp.cluster, cmp.hardware
    links = f"within a node {_link(cl.intra_gbs)}" + (
        f", between nodes {_link(cl.inter_gbs)}" if cl.nodes > 1 else "")
    lines = [
        f"layouts of {cl.nodes} node{'s' if cl.nodes > 1 else ''} x {cl.gpus_per_node} GPUs ({hw.name}), "
        f"host {gib_text(cl.host_bytes_per_node)} per node, {cmp.global_batch} x {cmp.seq} tokens/step "
        "in all",
        f"links: {links}",
        f"   {'layout':<31} {'tokens/s':>10} {'s/step':>7} {'comm s':>8} {'GPU peak':>9} "
        f"{'host/node':>10}  sharding",
    ]
    lines += [_row(r, cmp.best, cl.nodes) for r in cmp.rows]
    lines.append("   (comm s: exposed collectives + the sharded all-gather; GPU peak: the fullest GPU, "
                 "without NCCL buffers)")
    b = cmp.best
    if b is None or b.choice is None or b.choice.result is None:
        return "\n".join(lines)
    lay, c = b.layout, b.choice
    where = f"on {lay.nodes} of the {cl.nodes} nodes" if lay.nodes < cl.nodes else f"{lay.per_node} per node"
    parts = "" if lay.replicas == 1 else (
        f" = replica {c.replica_step_s:.2f} + collectives {c.exposed_s:.2f} exposed (of {c.collective_s:.2f})"
        + (f" + all-gather {c.allgather_s:.2f}" if c.sharding == "shard" else ""))
    lines += _wrapped(f"best: {lay.describe()} ({lay.kind}), {where}: {c.tokens_per_s:,.0f} tokens/s, "
                      f"{c.step_s:.2f} s/step{parts}")
    lines += _wrapped(f"optimizer state: {b.reason}")
    lines += _wrapped(f"plan per replica: {b.plan().describe()}")
    if detail:
        lines.append("")
        lines.append(f"one replica ({lay.gpus_per_replica} GPU{'s' if lay.gpus_per_replica > 1 else ''}, "
                     f"{cmp.global_batch // lay.replicas} of the {cmp.global_batch} sequences):")
        lines.append(format_plan(replica_view(b, cmp.cluster.host_bytes_per_node)))
    return "\n".join(lines)


def replica_view(row: LayoutPlan, host_per_node: int) -> PlanResult:
    """The chosen replica's result as one replica holds it: its host bytes (sharded: 1/R of the
    moments), its share of the node's host budget, the chosen plan only (the search's trade-offs
    were weighed with the unsharded host bytes)."""
    c = row.choice
    assert c is not None and c.result is not None
    best = c.result.best
    plan = row.plan()
    view = dataclasses.replace(best, plan=plan, memory=MemoryReport(dict(c.host), best.memory.devices),
                               host_need=sum(c.host.values()) + HOST_BASELINE_BYTES)
    return dataclasses.replace(c.result, best=view, pareto=[view],
                               cpu_memory_bytes=host_per_node // row.layout.per_node)
