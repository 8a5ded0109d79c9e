"""The least recompute a GPU budget forces: how many blocks could keep their activations.

A block whose activations stay on the device from its forward to its backward needs no
recompute; in the layer-wise schedule a pack's forward runs every micro-batch before any
backward, so what it keeps is what autograd saves for it for every token of the step. The blocks
that fit are bounded, per device, by what the plan leaves free of the budget. The arithmetic
only: the caller gives the plan's need per device and the bytes one block keeps
(bench/decompose.py takes them from the planner's memory estimate and per-token activation bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class KeepLimit:
    """The most blocks whose activations fit beside the plan, in all."""

    budget_bytes: int | None  # per device; None: no budget (nothing forces recompute)
    need_bytes: tuple[int, ...]  # the plan's need per device
    bytes_per_block: float  # one block's kept activations for the whole step
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


def keep_limit(need_bytes: Sequence[int], recomputing: Sequence[int], *, kept_now: int,
               bytes_per_block: float, budget_bytes: int | None) -> KeepLimit:
    """Per device ``d``: ``recomputing[d]`` blocks recompute there now (their backward runs on
    ``d``) and the plan needs ``need_bytes[d]``; each more block kept takes ``bytes_per_block``.
    ``kept_now`` blocks keep their activations already (counted in the need)."""
    if len(need_bytes) != len(recomputing):
        raise ValueError(f"{len(need_bytes)} device needs for {len(recomputing)} devices' block counts")
    total = kept_now + sum(recomputing)
    if budget_bytes is None:
        return KeepLimit(None, tuple(need_bytes), bytes_per_block, total, total)
    more = 0
    for need, blocks in zip(need_bytes, recomputing):
        room = max(0, budget_bytes - need)
        more += min(blocks, int(room // bytes_per_block) if bytes_per_block > 0 else blocks)
    return KeepLimit(budget_bytes, tuple(need_bytes), bytes_per_block, kept_now + more, total)
