"""Measured per-layer times (``tinypipe profile``) as the planner's compute model.

A profile holds, for one decoder block of some model shape at one compute precision, the
forward (no autograd), recompute (forward building the graph) and backward times at a grid of
micro-batch sizes and sequence lengths, plus the fused head's forward+backward time.

The cost model asks for *achieved FLOP rates*: each measured point becomes
``rate = flops(point) / time`` with the same FLOP count the cost model uses (a block's forward
``2 * N_block * T + 2 * S * heads * head_dim * T``; recompute = forward; backward = 2 x forward;
head forward+backward ``6 * N_head * T``). A query (S, T) takes the measured rates at the two
nearest sequence lengths (log-linear between them, held beyond the ends) and, within each, the
rate interpolated linearly in log T; above the largest measured T the rate is held; below the
smallest it falls off as T / (T + T0) (the cost model's efficiency curve). For the very block
that was profiled, ``flops / rate`` reproduces the measured time at every grid point; for another
shape it scales the measured efficiency by FLOPs.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

KINDS = ("forward", "recompute", "backward", "head")
#: Same constant as work.EFFICIENCY_T0 (kept here to avoid an import cycle).
_T0 = 684.0


@dataclass(frozen=True)
class ProfilePoint:
    seq: int
    micro_batch: int
    forward_s: float
    recompute_s: float
    backward_s: float
    head_s: float

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch


@dataclass(frozen=True)
class LayerProfile:
    """Per-layer times measured on one device for one block shape at one precision."""

    precision: str
    block_params: int  # raw parameter count of the profiled block
    attn_width: int  # heads * head_dim of the profiled block
    head_params: int  # parameters of the head's output matmul (vocab * hidden)
    points: tuple[ProfilePoint, ...]
    # bytes autograd keeps per token for one recomputed block, as measured (compiled blocks keep
    # less than the eager probe the planner otherwise uses); None: not measured
    act_bytes_per_token: float | None = None

    def activation_bytes_for(self, block_params: int, attn_width: int) -> float | None:
        """The measured saved bytes per token, if this profile is of the same block shape."""
        if self.act_bytes_per_token and block_params == self.block_params and attn_width == self.attn_width:
            return self.act_bytes_per_token
        return None

    # -- flops of the profiled shapes
    def _flops(self, kind: str, seq: int, tokens: float) -> float:
        if kind == "head":
            return 6.0 * self.head_params * tokens
        fwd = (2.0 * self.block_params + 2.0 * seq * self.attn_width) * tokens
        return 2.0 * fwd if kind == "backward" else fwd

    def _time(self, p: ProfilePoint, kind: str) -> float:
        return {"forward": p.forward_s, "recompute": p.recompute_s, "backward": p.backward_s,
                "head": p.head_s}[kind]

    def _rate_at_seq(self, kind: str, seq: int, tokens: float) -> float:
        pts = sorted((p for p in self.points if p.seq == seq and self._time(p, kind) > 0),
                     key=lambda p: p.tokens)
        if not pts:
            return 0.0
        xs = [math.log(p.tokens) for p in pts]
        rs = [self._flops(kind, p.seq, p.tokens) / self._time(p, kind) for p in pts]
        x = math.log(max(tokens, 1.0))
        if x >= xs[-1]:
            return rs[-1]
        if x <= xs[0]:
            t0 = pts[0].tokens
            return rs[0] * (tokens / (tokens + _T0)) / (t0 / (t0 + _T0))
        i = bisect.bisect_right(xs, x)
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return rs[i - 1] + w * (rs[i] - rs[i - 1])

    def rate(self, kind: str, seq: int, tokens: float) -> float:
        """Achieved FLOP/s of ``kind`` for micro-batches of ``tokens`` tokens of sequence ``seq``."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}")
        seqs = sorted({p.seq for p in self.points})
        if not seqs:
            return 0.0
        if kind == "head":  # the head runs in token chunks: sequence length hardly matters
            return max(self._rate_at_seq(kind, s, tokens) for s in seqs)
        if seq <= seqs[0] or len(seqs) == 1:
            return self._rate_at_seq(kind, seqs[0] if seq <= seqs[0] else seqs[-1], tokens)
        if seq >= seqs[-1]:
            return self._rate_at_seq(kind, seqs[-1], tokens)
        j = bisect.bisect_right(seqs, seq)
        lo, hi = seqs[j - 1], seqs[j]
        w = (math.log(seq) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return (1 - w) * self._rate_at_seq(kind, lo, tokens) + w * self._rate_at_seq(kind, hi, tokens)

    def block_time(self, kind: str, *, block_params: int, attn_width: int, seq: int,
                   micro_batch: int) -> float:
        """Seconds for one micro-batch through one block of the given shape (``kind`` in
        forward/recompute/backward)."""
        tokens = seq * micro_batch
        fwd = (2.0 * block_params + 2.0 * seq * attn_width) * tokens
        flops = 2.0 * fwd if kind == "backward" else fwd
        return flops / self.rate(kind, seq, tokens)

    def best_rate(self, kind: str = "forward") -> float:
        """The highest measured achieved rate of ``kind`` (FLOP/s)."""
        return max(self._flops(kind, p.seq, p.tokens) / self._time(p, kind) for p in self.points
                   if self._time(p, kind) > 0)

    def as_dict(self) -> dict:
        return {"precision": self.precision, "block_params": self.block_params, "attn_width": self.attn_width,
                "head_params": self.head_params, "act_bytes_per_token": self.act_bytes_per_token,
                "points": [{"seq": p.seq, "micro_batch": p.micro_batch, "tokens": p.tokens,
                            "forward_s": p.forward_s, "recompute_s": p.recompute_s,
                            "backward_s": p.backward_s, "head_s": p.head_s}
                           for p in self.points]}

    @classmethod
    def from_dict(cls, d: dict) -> "LayerProfile":
        pts = []
        for p in d["points"]:
            pt = ProfilePoint(int(p["seq"]), int(p["micro_batch"]), float(p["forward_s"]),
                              float(p["recompute_s"]), float(p["backward_s"]), float(p.get("head_s", 0.0)))
            if pt.seq < 1 or pt.micro_batch < 1 or not (
                    pt.forward_s > 0 and pt.recompute_s > 0 and pt.backward_s > 0):
                raise ValueError(f"bad profile point {p}")
            pts.append(pt)
        if not pts:
            raise ValueError("no measured points")
        act = d.get("act_bytes_per_token")
        prof = cls(str(d.get("precision", "bf16")), int(d["block_params"]), int(d["attn_width"]),
                   int(d.get("head_params", 0)), tuple(pts), float(act) if act else None)
        if prof.block_params < 1 or prof.attn_width < 1:
            raise ValueError("block_params and attn_width must be positive")
        return prof
