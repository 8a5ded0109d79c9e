"""The physical bound of a step and how much transfer/optimizer time hid behind compute."""

from __future__ import annotations

from dataclasses import dataclass

from tinypipe.perf.machine import MachineRates


@dataclass
class Bound:
    compute_s: float
    upload_s: float
    download_s: float
    optimizer_s: float

    @property
    def bound_s(self) -> float:
        return max(self.compute_s, self.upload_s, self.download_s, self.optimizer_s)

    def rows(self) -> list[tuple[str, float]]:
        return [("compute", self.compute_s), ("upload", self.upload_s), ("download", self.download_s),
                ("cpu optimizer", self.optimizer_s)]


def step_bound(params: int, block_params: int, head_params: int, layers: int, hidden: int, seq: int,
               batch: int, rates: MachineRates, upload_bytes_per_param: float = 4.0, passes: int = 2,
               download_bytes_per_param: float = 4.0, recompute: bool = True) -> Bound:
    """max(compute, upload, download, optimizer) from measured rates.

    Compute counts matmul FLOPs: forward 2*N*T for the blocks, again for the recompute, 4*N*T for
    the backward; the head's forward+backward (6*N*T, no recompute); causal attention
    (2 * 2 * S^2 * hidden per sequence and layer, halved for causality, x3 fwd+bwd, +1 recompute).
    """
    tokens = seq * batch
    fwd_mult = 4 if recompute else 3
    flops = fwd_mult * 2 * block_params * tokens + 6 * head_params * tokens
    flops += (fwd_mult * 2 * seq * seq * hidden * batch) * layers
    compute = flops / (rates.matmul_tflops * 1e12) if rates.matmul_tflops else float("nan")
    up = (passes * block_params * upload_bytes_per_param / (rates.h2d_gbs * 1e9) if rates.h2d_gbs
          else float("nan"))
    down = params * download_bytes_per_param / (rates.d2h_gbs * 1e9) if rates.d2h_gbs else float("nan")
    opt = params / (rates.adamw_gparams_s * 1e9)
    return Bound(compute, up, down, opt)


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


def overlap_table(events: list[dict]) -> list[tuple[str, float, float]]:
    """(lane, busy seconds, fraction of that time during which some compute lane was busy)."""
    busy = lane_busy(events)
    compute: list[tuple[float, float]] = []
    for lane, iv in busy.items():
        if lane.endswith(":compute"):
            compute += iv
    compute = lane_busy([{"lane": "c", "start_us": a, "dur_us": b - a} for a, b in compute]).get("c", [])
    rows = []
    for lane, iv in sorted(busy.items()):
        tot = _total(iv)
        hidden = _intersect(iv, compute) / tot if tot else 1.0
        rows.append((lane, tot / 1e6, hidden))
    return rows
