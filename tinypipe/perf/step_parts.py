"""The measured step, part by part, from its timeline: compute (forward, head, backward), recompute,
exposed upload / download / optimizer, and what is left (other lanes, idle) -- seconds that sum to
the step's time.

Every instant of the step ``[0, step_s]`` is counted once. While a compute lane is busy the
instant is compute, shared equally among the compute tasks running then (several devices) and
named by their kind; otherwise it is *exposed* time of the busiest-blocking lane busy then, in the
order upload > download > optimizer > other (a host AdamW update streams its layer's gradient
chunks: its span covers the wait for a download that is still running, which is exposed download,
not optimizer time); an instant with no lane busy is idle. ``exposed_any`` also gives, per lane
kind, all the time it is busy while no compute lane is (overlapping one another; not additive).

The trace does not separate a backward task's recompute from its backward: each ``bwd`` task's
time is split by the planner's time model (:func:`recompute_share`), so ``recompute`` is
modelled, not measured. A sub-span around the recompute in the backward handler would make it
measured.
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

from tinypipe.planner.cost import StepTime
from tinypipe.planner.hardware import HardwareSpec
from tinypipe.schedule.ids import Kind, Lane, TaskId

#: The parts of a step, in the order tables print them.
PARTS = ("forward", "head", "backward", "recompute", "other compute", "exposed upload", "exposed download",
         "exposed optimizer", "exposed other", "idle")
#: Lane kinds by exposure precedence (see the module doc).
_EXPOSED = ("upload", "download", "optimizer", "other")
_STREAM_ROLE = {"compute": "compute", "h2d": "upload", "d2h": "download"}
_HOST_ROLE = {"optimizer": "optimizer", "deferred-optimizer": "optimizer"}


def lane_role(lane: str) -> str:
    """``compute``, ``upload``, ``download``, ``optimizer`` or ``other`` (collectives, SSD)."""
    try:
        parsed = Lane.parse(lane)
    except ValueError:
        return "other"
    if parsed.device is None:
        return _HOST_ROLE.get(parsed.name, "other")
    return _STREAM_ROLE.get(parsed.name, "other")


def recompute_share(hw: HardwareSpec, precision: str, seq: int, bwd_tokens: int, lora: bool = False) -> float:
    """The recompute's share of a recomputing backward task in the planner's time model:
    (F / r_recompute) / (F / r_recompute + m F / r_backward), m = 2 (1 under LoRA, which skips
    the frozen weights' gradient GEMMs). With the efficiency curve the two rates are one (1/3, LoRA
    1/2); a measured profile at ``precision`` gives its own rates at ``bwd_tokens``."""
    m = 1.0 if lora else 2.0
    prof = hw.layer_profile
    if prof is not None and prof.precision == precision:
        rrc, rbw = prof.rate("recompute", seq, bwd_tokens), prof.rate("backward", seq, bwd_tokens)
        if rrc > 0 and rbw > 0:
            return (1.0 / rrc) / (1.0 / rrc + m / rbw)
    return 1.0 / (1.0 + m)


def _compute_split(name: str, share: float, recomputes: Sequence[bool] | None) -> dict[str, float]:
    """Which parts a compute task's time goes to (fractions summing to 1)."""
    try:
        tid = TaskId.parse(name)
    except ValueError:
        return {"other compute": 1.0}
    if tid.kind in (Kind.FWD, Kind.EMBED_FWD):
        return {"forward": 1.0}
    if tid.kind is Kind.HEAD:
        return {"head": 1.0}
    if tid.kind is Kind.EMBED_BWD:
        return {"backward": 1.0}
    if tid.kind is Kind.BWD:
        q = tid.pack or 0
        recomputed = recomputes is None or (q < len(recomputes) and recomputes[q])
        r = share if recomputed else 0.0
        return {"backward": 1.0 - r, "recompute": r}
    return {"other compute": 1.0}


def decompose(events: Sequence[Mapping], step_s: float, *, recompute_share: float = 0.0,
              recomputes: Sequence[bool] | None = None) -> dict:
    """``events`` (``{"lane", "name", "start_us", "dur_us"}``, microseconds since the step began,
    as :meth:`tinypipe.Engine.step_timeline` gives them) as seconds per part of a step that took
    ``step_s``: ``{"parts": {part: s}, "exposed_any": {lane kind: s}, "step_s", "recompute_share"}``.
    A ``bwd`` task of a recomputing pack (``recomputes[q]``; None: every pack) gives
    ``recompute_share`` of its time to ``recompute``. Events are clipped to ``[0, step_s]``."""
    if step_s <= 0:
        raise ValueError(f"step_s must be positive, got {step_s}")
    points: list[tuple[float, int, int]] = []
    roles: list[str] = []
    splits: list[dict[str, float]] = []
    for i, e in enumerate(events):
        a = max(0.0, e["start_us"] / 1e6)
        b = min(step_s, (e["start_us"] + e["dur_us"]) / 1e6)
        role = lane_role(e["lane"])
        roles.append(role)
        splits.append(_compute_split(e["name"], recompute_share, recomputes) if role == "compute" else {})
        if b > a:
            points += [(a, 1, i), (b, -1, i)]
    points.sort()
    parts = dict.fromkeys(PARTS, 0.0)
    exposed_any = dict.fromkeys(_EXPOSED, 0.0)
    computing: dict[int, dict[str, float]] = {}
    busy: Counter[str] = Counter()

    def account(dt: float) -> None:
        if dt <= 0:
            return
        if computing:
            share = dt / len(computing)
            for split in computing.values():
                for part, f in split.items():
                    parts[part] += share * f
            return
        lanes = [r for r in _EXPOSED if busy[r] > 0]
        for r in lanes:
            exposed_any[r] += dt
        parts[f"exposed {lanes[0]}" if lanes else "idle"] += dt

    prev = 0.0
    for t, kind, i in points:
        account(t - prev)
        prev = t
        if roles[i] == "compute":
            if kind > 0:
                computing[i] = splits[i]
            else:
                computing.pop(i, None)
        else:
            busy[roles[i]] += kind
    account(step_s - prev)
    return {"step_s": step_s, "parts": parts, "exposed_any": exposed_any, "recompute_share": recompute_share}


def phases(events: Sequence[Mapping], step_s: float) -> dict[str, float]:
    """The step's phases as the planner's time model has them, measured on the compute lanes:
    ``fill`` (until the first pack's forward), ``forward`` (until the first head task), ``head +
    backward`` (until the last backward task ends), ``tail`` (the rest of the step); ``head tasks``
    the head's own compute (its tasks' summed time). Empty without forward, head and backward tasks."""
    starts: dict[Kind, float] = {}
    bwd_end = None
    head_s = 0.0
    for e in events:
        if lane_role(e["lane"]) != "compute":
            continue
        try:
            kind = TaskId.parse(e["name"]).kind
        except ValueError:
            continue
        a, b = e["start_us"] / 1e6, (e["start_us"] + e["dur_us"]) / 1e6
        starts[kind] = min(starts.get(kind, a), a)
        if kind is Kind.HEAD:
            head_s += b - a
        if kind in (Kind.BWD, Kind.EMBED_BWD):
            bwd_end = b if bwd_end is None else max(bwd_end, b)
    if Kind.FWD not in starts or Kind.HEAD not in starts or bwd_end is None:
        return {}
    f0, h0, b1 = max(0.0, starts[Kind.FWD]), starts[Kind.HEAD], min(step_s, bwd_end)
    return {"fill": f0, "forward": h0 - f0, "head + backward": b1 - h0, "tail": step_s - b1,
            "head tasks": head_s}


def predicted_phases(t: StepTime) -> dict[str, float]:
    """The time model's phases in :func:`phases`' names."""
    return {"fill": t.fill_s, "forward": t.forward_s, "head + backward": t.head_s + t.backward_s,
            "tail": t.tail_s, "head tasks": t.head_s}
