"""A step's time, part by part, from busy spans: compute (by the parts each compute span names),
exposed upload / download / optimizer / other, and idle -- seconds that sum to the step's time.

Every instant of the step ``[0, step_s]`` is counted once. While a compute span is running the
instant is compute, shared equally among the compute spans running then (several devices) and
split by each span's ``parts`` fractions; otherwise it is *exposed* time of the lane kind busy
then that comes first in the order upload > download > optimizer > other (a host AdamW update
streams its layer's gradient chunks: its span covers the wait for a download that is still
running, which is exposed download, not optimizer time); an instant with nothing busy is idle.
``exposed_any`` gives, per lane kind, all the time it is busy while no compute span is
(overlapping one another: not additive).

The machine-level arithmetic only: which task is which part comes from the caller
(bench/decompose.py turns an engine's timeline into :class:`Span` s).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Sequence

#: The parts of a step, in the order tables print them.
PARTS = ("forward", "head", "backward", "recompute", "other compute", "exposed upload", "exposed download",
         "exposed optimizer", "exposed other", "idle")
#: Lane kinds of non-compute spans, by exposure precedence (see the module doc).
EXPOSED_ROLES = ("upload", "download", "optimizer", "other")
COMPUTE_PARTS = PARTS[:5]


@dataclass(frozen=True)
class Span:
    """One busy interval (seconds since the step began) of a lane kind: ``compute`` or one of
    :data:`EXPOSED_ROLES`; a compute span's ``parts`` are fractions of its time (summing to 1)
    by :data:`COMPUTE_PARTS` names."""

    start_s: float
    end_s: float
    role: str
    parts: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role != "compute" and self.role not in EXPOSED_ROLES:
            raise ValueError(f"span role must be compute or one of {EXPOSED_ROLES}, got {self.role!r}")
        if self.role == "compute":
            if set(self.parts) - set(COMPUTE_PARTS) or abs(sum(self.parts.values()) - 1.0) > 1e-9:
                raise ValueError(f"a compute span's parts are fractions of {COMPUTE_PARTS} summing to 1, "
                                 f"got {dict(self.parts)}")


def decompose(spans: Sequence[Span], step_s: float) -> dict:
    """``{"step_s", "parts": {part: s}, "exposed_any": {role: s}}`` for a step of ``step_s``
    seconds; spans are clipped to ``[0, step_s]``."""
    if step_s <= 0:
        raise ValueError(f"step_s must be positive, got {step_s}")
    points: list[tuple[float, int, int]] = []
    for i, sp in enumerate(spans):
        a, b = max(0.0, sp.start_s), min(step_s, sp.end_s)
        if b > a:
            points += [(a, 1, i), (b, -1, i)]
    points.sort()
    parts = dict.fromkeys(PARTS, 0.0)
    exposed_any = dict.fromkeys(EXPOSED_ROLES, 0.0)
    computing: set[int] = set()
    busy: Counter[str] = Counter()

    def account(dt: float) -> None:
        if dt <= 0:
            return
        if computing:
            share = dt / len(computing)
            for i in computing:
                for part, f in spans[i].parts.items():
                    parts[part] += share * f
            return
        roles = [r for r in EXPOSED_ROLES if busy[r] > 0]
        for r in roles:
            exposed_any[r] += dt
        parts[f"exposed {roles[0]}" if roles else "idle"] += dt

    prev = 0.0
    for t, kind, i in points:
        account(t - prev)
        prev = t
        if spans[i].role == "compute":
            (computing.add if kind > 0 else computing.discard)(i)
        else:
            busy[spans[i].role] += kind
    account(step_s - prev)
    return {"step_s": step_s, "parts": parts, "exposed_any": exposed_any}
