"""The physical bound of a step and how much transfer/optimizer time hid behind compute."""

from __future__ import annotations

from dataclasses import dataclass

from tinypipe.devices.rates import MachineRates
from tinypipe.schedule.ids import Lane


@dataclass
class Bound:
    """Each resource's seconds per step; the compute three ways (see :func:`step_bound`).

    ``compute_s`` is the compute of the plan as it runs (its recompute included);
    ``compute_no_recompute_s`` the same work without any recompute -- the ceiling no plan beats;
    ``compute_forced_s`` the compute with only the recompute the GPU memory forces (None: not
    asked for). ``bound_s`` is the plan's bound, ``ceiling_s`` the no-recompute one and
    ``forced_bound_s`` the best a plan that recomputes only what memory forces could reach.
    """

    compute_s: float
    upload_s: float
    download_s: float
    optimizer_s: float
    compute_no_recompute_s: float = float("nan")
    compute_forced_s: float | None = None
    recompute_fraction: float = 1.0  # of the blocks' forward FLOPs the plan recomputes
    forced_fraction: float | None = None  # the least that memory forces

    def _others(self) -> float:
        return max(self.upload_s, self.download_s, self.optimizer_s)

    @property
    def bound_s(self) -> float:
        return max(self.compute_s, self._others())

    @property
    def ceiling_s(self) -> float:
        """The bound with no recompute at all."""
        return max(self.compute_no_recompute_s, self._others())

    @property
    def forced_bound_s(self) -> float | None:
        """The bound with only the recompute memory forces (None: not known)."""
        return None if self.compute_forced_s is None else max(self.compute_forced_s, self._others())

    def rows(self) -> list[tuple[str, float]]:
        return [("compute", self.compute_s), ("upload", self.upload_s), ("download", self.download_s),
                ("cpu optimizer", self.optimizer_s)]

    def compute_rows(self) -> list[tuple[str, float]]:
        """The compute without recompute, with the plan's and with the forced recompute."""
        rows = [("compute, no recompute", self.compute_no_recompute_s),
                (f"compute, plan's recompute ({self.recompute_fraction:.0%} of blocks)", self.compute_s)]
        if self.compute_forced_s is not None and self.forced_fraction is not None:
            rows.append((f"compute, forced recompute ({self.forced_fraction:.0%})", self.compute_forced_s))
        return rows

    def as_dict(self) -> dict:
        """The rows by name, ``bound_s``, and the recompute variants (the JSON's ``bound``)."""
        return {k: v for k, v in self.rows()} | {
            "bound_s": self.bound_s, "compute_no_recompute": self.compute_no_recompute_s,
            "ceiling_s": self.ceiling_s, "recompute_fraction": self.recompute_fraction,
            "compute_forced_recompute": self.compute_forced_s,
            "forced_recompute_fraction": self.forced_fraction, "forced_bound_s": self.forced_bound_s}


def step_flops(block_params: int, head_params: int, layers: int, hidden: int, seq: int, batch: int,
               recompute_fraction: float = 1.0) -> float:
    """Matmul FLOPs of one step: the blocks' forward 2*N*T plus causal attention (2 * 2 * S^2 *
    hidden per sequence and layer, halved for causality), the backward twice that, the recompute
    ``recompute_fraction`` of it again (0: none, 1: every block); the head's forward+backward 6*N*T
    (never recomputed)."""
    if not 0.0 <= recompute_fraction <= 1.0:
        raise ValueError(f"recompute_fraction must be in [0, 1], got {recompute_fraction}")
    tokens = seq * batch
    block_fwd = 2 * block_params * tokens + 2 * seq * seq * hidden * batch * layers
    return (3 + recompute_fraction) * block_fwd + 6 * head_params * tokens


def step_bound(params: int, block_params: int, head_params: int, layers: int, hidden: int, seq: int,
               batch: int, rates: MachineRates, upload_bytes_per_param: float = 4.0, passes: int = 2,
               download_bytes_per_param: float = 4.0, recompute: bool = True,
               recompute_fraction: float | None = None, forced_fraction: float | None = None) -> Bound:
    """max(compute, upload, download, optimizer) from measured rates.

    Compute counts matmul FLOPs (:func:`step_flops`) at the measured matmul rate, three ways: with
    the plan's recompute (``recompute_fraction`` of the blocks, by count -- blocks of one model
    have one size; default 1 with ``recompute``, else 0), with none, and -- given
    ``forced_fraction``, the least memory forces (:func:`benchkit.keep_limit.keep_limit`)
    -- with that.
    """
    frac = (1.0 if recompute else 0.0) if recompute_fraction is None else recompute_fraction
    rate = rates.matmul_tflops * 1e12

    def compute(f: float) -> float:
        flops = step_flops(block_params, head_params, layers, hidden, seq, batch, f)
        return flops / rate if rate else float("nan")

    up = (passes * block_params * upload_bytes_per_param / (rates.h2d_gbs * 1e9) if rates.h2d_gbs
          else float("nan"))
    down = params * download_bytes_per_param / (rates.d2h_gbs * 1e9) if rates.d2h_gbs else float("nan")
    opt = params / (rates.adamw_gparams_s * 1e9)
    return Bound(compute(frac), up, down, opt, compute_no_recompute_s=compute(0.0),
                 compute_forced_s=None if forced_fraction is None else compute(forced_fraction),
                 recompute_fraction=frac, forced_fraction=forced_fraction)


def lane_busy(events: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Merged busy intervals (us) per lane from trace events."""
    by: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        by.setdefault(e["lane"], []).append((e["start_us"], e["start_us"] + e["dur_us"]))
    out = {}
    for lane, iv in by.items():
        iv.sort()
        merged: list[tuple[float, float]] = []
        for a, b in iv:
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        out[lane] = merged
    return out


def _total(iv: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in iv)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            tot += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def is_compute_lane(lane: str) -> bool:
    """Whether a trace event's lane (its text) is a device's compute lane."""
    try:
        parsed = Lane.parse(lane)
    except ValueError:  # a lane outside the schedule (the SSD tier's)
        return False
    return parsed.device is not None and parsed.name == "compute"


def overlap_table(events: list[dict]) -> list[tuple[str, float, float]]:
    """(lane, busy seconds, fraction of that time during which some compute lane was busy)."""
    busy = lane_busy(events)
    compute: list[tuple[float, float]] = []
    for lane, iv in busy.items():
        if is_compute_lane(lane):
            compute += iv
    compute = lane_busy([{"lane": "c", "start_us": a, "dur_us": b - a} for a, b in compute]).get("c", [])
    rows = []
    for lane, iv in sorted(busy.items()):
        tot = _total(iv)
        hidden = _intersect(iv, compute) / tot if tot else 1.0
        rows.append((lane, tot / 1e6, hidden))
    return rows
