"""How much recompute a plan does, and the least its GPU memory forces.

A block whose activations are kept on the device from its forward to its backward needs no
recompute; what it keeps is what autograd saves for it, for every token of the step (the
planner's ``ModelSizes.block_act_bytes`` per token, or a measured profile's value). With a GPU
budget, the blocks that can be kept are bounded by what the plan leaves free: the budget minus
the plan's estimated need (static pools + activation peak + the planner's headroom,
:func:`tinypipe.planner.candidate.gpu_need`). The estimate is conservative: the all-recompute
plan's whole activation peak stays counted though a kept block no longer needs its backward
working set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tinypipe.memory.report import MemoryReport
from tinypipe.planner.candidate import FRAGMENTATION, GPU_CONTEXT_BYTES
from tinypipe.schedule.plan import Plan


def pack_recomputes(plan: Plan) -> tuple[bool, ...]:
    """Per pack, whether its backward recomputes its forward. ``Plan.keep_activations`` (one
    entry per pack; a bool, or a placement string where only ``"recompute"`` recomputes) marks
    the packs that keep their activations; a plan without that field recomputes every pack."""
    keep: Sequence = tuple(getattr(plan, "keep_activations", ()) or ())
    out = []
    for q in range(plan.num_packs):
        v = keep[q] if q < len(keep) else False
        kept = v != "recompute" if isinstance(v, str) else bool(v)
        out.append(not kept)
    return tuple(out)


def recomputed_blocks(plan: Plan) -> int:
    """Blocks whose forward the plan's backward runs again."""
    return sum(len(p) for p, r in zip(plan.packs, pack_recomputes(plan)) if r)


@dataclass(frozen=True)
class KeepLimit:
    """The most blocks whose activations fit beside the plan, per device and in all."""

    budget_bytes: int | None  # per device; None: no budget (nothing forces recompute)
    need_bytes: tuple[int, ...]  # the plan's estimated need per device (headroom included)
    bytes_per_block: float  # one block's kept activations for the whole step (fragmentation included)
    keepable_blocks: int  # at most, the blocks the plan keeps already included
    num_blocks: int

    @property
    def forced_blocks(self) -> int:
        """The least number of blocks that must recompute."""
        return self.num_blocks - self.keepable_blocks

    @property
    def forced_fraction(self) -> float:
        return self.forced_blocks / self.num_blocks if self.num_blocks else 0.0

    def as_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "need_bytes": list(self.need_bytes),
                "bytes_per_block": self.bytes_per_block, "keepable_blocks": self.keepable_blocks,
                "num_blocks": self.num_blocks, "forced_blocks": self.forced_blocks,
                "forced_fraction": self.forced_fraction}

    def describe(self) -> str:
        if self.budget_bytes is None:
            return f"no GPU budget: all {self.num_blocks} blocks could keep their activations"
        gib = 1024**3
        free = [max(0, self.budget_bytes - n) / gib for n in self.need_bytes]
        return (f"GPU budget {self.budget_bytes / gib:.1f} GiB, plan needs "
                f"{'/'.join(f'{n / gib:.1f}' for n in self.need_bytes)} GiB "
                f"(free {'/'.join(f'{f:.1f}' for f in free)}); one block keeps "
                f"{self.bytes_per_block / gib:.2f} GiB -> at most {self.keepable_blocks} of "
                f"{self.num_blocks} blocks kept, {self.forced_blocks} must recompute")


def keep_limit(plan: Plan, memory: MemoryReport, *, budget_bytes: int | None, tokens: int,
               act_bytes_per_token: float) -> KeepLimit:
    """The blocks ``plan`` could keep on its devices within ``budget_bytes`` each, ``memory``
    being the planner's estimate for the plan (:func:`tinypipe.planner.estimate.estimate_memory`,
    device entries in device order) and ``tokens`` the step's tokens."""
    per_block = tokens * act_bytes_per_token * (1.0 + FRAGMENTATION)
    needs = []
    for name, cats in memory.devices.items():
        act = cats.get("activations_peak", 0)
        needs.append(memory.device_total(name) + act + int(FRAGMENTATION * act) + GPU_CONTEXT_BYTES)
    recomputes = pack_recomputes(plan)
    kept_now = plan.num_blocks - recomputed_blocks(plan)
    if budget_bytes is None:
        return KeepLimit(None, tuple(needs), per_block, plan.num_blocks, plan.num_blocks)
    more = 0
    for d, need in enumerate(needs):
        # counted on the device that runs the pack's backward (which reads them)
        candidates = sum(len(p) for q, p in enumerate(plan.packs)
                         if recomputes[q] and (plan.bwd_device[q] if plan.bwd_device else 0) == d)
        room = max(0, budget_bytes - need)
        more += min(candidates, int(room // per_block) if per_block > 0 else candidates)
    return KeepLimit(budget_bytes, tuple(needs), per_block, kept_now + more, plan.num_blocks)
