"""The most recompute that offloading activations to host memory could save in a measured step.

A block that offloads instead of recomputing sends what autograd saves for it -- for every token
of the step, :attr:`~benchkit.keep_limit.KeepLimit.bytes_per_block` -- down during the
forward and brings it back up during the backward. That only costs nothing where the link is
idle: the device-to-host time the forward phase leaves free and the host-to-device time the head
and backward leave free. So the blocks that can offload at no cost are at most
``min(idle D2H in the forward x D2H rate, idle H2D in the backward x H2D rate) / bytes_per_block``,
and each saves its share of the measured recompute. Measured on an H200 (W1 at 24 GiB, 16 x 2048
tokens, ``bench/results/s7_w1_final.json``): about 4 blocks, ~3 % of the step -- on that link
offloading is no way to the no-recompute ceiling. The arithmetic only: the caller gives the
phases, the lanes' busy seconds in them and the rates (``bench/run.py`` prints it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OffloadLimit:
    """Link time the phases leave idle, and what it could carry instead of recompute."""

    forward_s: float  # the forward phase (first forward to first head task)
    backward_s: float  # the head and the backward
    d2h_busy_forward_s: float  # the D2H lanes' busy time inside the forward phase (all devices)
    h2d_busy_backward_s: float  # the H2D lanes' busy time inside the head and backward phase
    devices: int
    d2h_bytes_per_s: float  # per device
    h2d_bytes_per_s: float
    bytes_per_block: float  # one block's saved activations for the whole step
    recompute_s: float  # the step's recompute (measured sub-spans or the modelled share)
    recomputed_blocks: int

    @property
    def idle_d2h_bytes(self) -> float:
        return max(0.0, self.devices * self.forward_s - self.d2h_busy_forward_s) * self.d2h_bytes_per_s

    @property
    def idle_h2d_bytes(self) -> float:
        return max(0.0, self.devices * self.backward_s - self.h2d_busy_backward_s) * self.h2d_bytes_per_s

    @property
    def blocks(self) -> int:
        """Blocks whose activations the idle link time could carry down and back up."""
        if self.bytes_per_block <= 0:
            return 0
        fit = int(min(self.idle_d2h_bytes, self.idle_h2d_bytes) // self.bytes_per_block)
        return min(fit, self.recomputed_blocks)

    @property
    def saved_s(self) -> float:
        """Recompute seconds those blocks would no longer spend."""
        if not self.recomputed_blocks:
            return 0.0
        return self.blocks * self.recompute_s / self.recomputed_blocks

    def as_dict(self) -> dict:
        return {"forward_s": self.forward_s, "backward_s": self.backward_s,
                "d2h_busy_forward_s": self.d2h_busy_forward_s,
                "h2d_busy_backward_s": self.h2d_busy_backward_s,
                "idle_d2h_bytes": self.idle_d2h_bytes, "idle_h2d_bytes": self.idle_h2d_bytes,
                "bytes_per_block": self.bytes_per_block, "blocks": self.blocks,
                "recompute_s": self.recompute_s, "saved_s": self.saved_s}

    def describe(self, step_s: float) -> str:
        gb = 1e9
        return (f"offloading activations instead of recomputing: the forward leaves "
                f"{self.idle_d2h_bytes / gb:.1f} GB of D2H idle, the backward "
                f"{self.idle_h2d_bytes / gb:.1f} GB of H2D; one block's activations are "
                f"{self.bytes_per_block / gb:.2f} GB -> {self.blocks} of {self.recomputed_blocks} blocks, "
                f"{self.saved_s:.3f} s of {self.recompute_s:.3f} s recompute "
                f"({self.saved_s / step_s:.1%} of the step) at most")


def busy_within(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of ``intervals`` (merged, [start, end) seconds) inside ``[lo, hi]``."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)
