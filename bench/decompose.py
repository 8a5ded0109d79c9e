"""An engine's step, decomposed: its timeline as compute / recompute / exposed transfer and optimizer
/ idle seconds (:mod:`benchkit.step_parts`) and its phases next to the time model's, and the
recompute the plan does and the least the GPU budget forces (:mod:`benchkit.keep_limit`).
bench/run.py prints and records them.

Lanes and task kinds are the engine's (:mod:`tinypipe.schedule.ids`): ``devN:compute`` runs
``efwd``, ``fwd``, ``head``, ``bwd``, ``ebwd``; ``devN:h2d`` the uploads, ``devN:d2h`` the
gradient downloads, ``host:optimizer`` / ``host:deferred-optimizer`` the host AdamW; the rest
(collectives, SSD) is "other". A traced step (``Config.trace``) records the recompute inside each
recomputing ``bwd`` task as its own sub-span (``"<bwd id>/recompute"``, ``"parent"``: the task; its
own CUDA event pair on the task's stream, host times on the CPU): with those, ``recompute`` is their
time and ``backward`` the rest of the task -- measured. Without them (an untraced step) each ``bwd``
task of a recomputing pack gives the time model's recompute share (:func:`recompute_share`) of its
time to ``recompute`` -- modelled. ``recompute_measured`` in the result says which.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from benchkit.analysis import lane_busy
from benchkit.keep_limit import KeepLimit, keep_limit
from benchkit.offload_limit import OffloadLimit, busy_within
from benchkit.step_parts import Span, decompose
from tinypipe.memory.report import MemoryReport
from tinypipe.planner.candidate import FRAGMENTATION, GPU_CONTEXT_BYTES
from tinypipe.planner.cost import StepTime
from tinypipe.planner.hardware import HardwareSpec
from tinypipe.schedule.ids import Kind, Lane, TaskId
from tinypipe.schedule.plan import Plan

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


def pack_recomputes(plan: Plan) -> tuple[bool, ...]:
    """Per pack, whether its backward recomputes its forward: all but the packs
    ``Plan.keep_activations`` keeps (empty: every pack recomputes)."""
    keep = plan.keep_activations
    return tuple(not (q < len(keep) and keep[q]) for q in range(plan.num_packs))


def recomputed_blocks(plan: Plan) -> int:
    """Blocks whose forward the plan's backward runs again."""
    return sum(len(p) for p, r in zip(plan.packs, pack_recomputes(plan)) if r)


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


def _compute_parts(name: str, share: float, recomputes: Sequence[bool] | None) -> dict[str, float]:
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
        r = share if recomputes is None or (q < len(recomputes) and recomputes[q]) else 0.0
        return {"backward": 1.0 - r, "recompute": r}
    return {"other compute": 1.0}


def _seconds(e: Mapping) -> tuple[float, float]:
    return e["start_us"] / 1e6, (e["start_us"] + e["dur_us"]) / 1e6


def recompute_spans(events: Sequence[Mapping]) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """The measured recompute sub-spans, (lane, task id) -> their [start, end) seconds, in order."""
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for e in events:
        if e.get("parent") is not None and e["name"].endswith("/recompute"):
            out.setdefault((e["lane"], e["parent"]), []).append(_seconds(e))
    return {k: sorted(v) for k, v in out.items()}


def _split(a: float, b: float, subs: Sequence[tuple[float, float]]) -> list[Span]:
    """A backward task ``[a, b)`` as compute spans in time order: ``recompute`` inside its measured
    sub-spans (clipped to the task), ``backward`` around them."""
    out, cur = [], a
    for s0, s1 in subs:
        s0, s1 = max(cur, min(b, s0)), max(cur, min(b, s1))
        if s0 > cur:
            out.append(Span(cur, s0, "compute", {"backward": 1.0}))
        if s1 > s0:
            out.append(Span(s0, s1, "compute", {"recompute": 1.0}))
        cur = max(cur, s1)
    if b > cur or not out:
        out.append(Span(cur, b, "compute", {"backward": 1.0}))
    return out


def spans(events: Sequence[Mapping], *, recompute_share: float = 0.0,
          recomputes: Sequence[bool] | None = None) -> list[Span]:
    """Timeline events (``{"lane", "name", "start_us", "dur_us"}`` since the step began, as
    :meth:`tinypipe.Engine.step_timeline` gives them) as :class:`Span` s. With measured recompute
    sub-spans among them (a traced step), each ``bwd`` task is split at its sub-spans (none: all
    backward); without, a ``bwd`` task of a recomputing pack (``recomputes[q]``; None: every pack)
    gives ``recompute_share`` of its time to ``recompute``. Sub-span events are no spans of their own."""
    measured = recompute_spans(events)
    share = 0.0 if measured else recompute_share
    out = []
    for e in events:
        if e.get("parent") is not None:
            continue
        role = lane_role(e["lane"])
        a, b = _seconds(e)
        if role != "compute":
            out.append(Span(a, b, role))
            continue
        parts = _compute_parts(e["name"], share, recomputes)
        if measured and "recompute" in parts:  # a bwd task
            out += _split(a, b, measured.get((e["lane"], e["name"]), []))
        else:
            out.append(Span(a, b, role, parts))
    return out


def step_decomposition(events: Sequence[Mapping], step_s: float, *, recompute_share: float = 0.0,
                       recomputes: Sequence[bool] | None = None) -> dict:
    """:func:`benchkit.step_parts.decompose` of the timeline, with the modelled share it was
    given, whether the recompute was measured instead (``recompute_measured``: the timeline has
    recompute sub-spans) and how many sub-spans there were (``recompute_spans``)."""
    parts = decompose(spans(events, recompute_share=recompute_share, recomputes=recomputes), step_s)
    n = sum(len(v) for v in recompute_spans(events).values())
    return parts | {"recompute_share": recompute_share, "recompute_measured": n > 0, "recompute_spans": n}


def phases(events: Sequence[Mapping], step_s: float) -> dict[str, float]:
    """The step's phases as the planner's time model has them, measured on the compute lanes:
    ``fill`` (until the first pack's forward), ``forward`` (until the first head task), ``head +
    backward`` (until the last backward task ends), ``tail`` (the rest of the step); ``head tasks``
    the head's own compute (its tasks' summed time). Empty without forward, head and backward tasks."""
    starts: dict[Kind, float] = {}
    bwd_end = None
    head_s = 0.0
    for e in events:
        if lane_role(e["lane"]) != "compute" or e.get("parent") is not None:
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


def plan_keep_limit(plan: Plan, memory: MemoryReport, *, budget_bytes: int | None, tokens: int,
                    act_bytes_per_token: float) -> KeepLimit:
    """The blocks ``plan`` could keep within ``budget_bytes`` per device. ``memory`` is the planner's
    estimate for the plan (:func:`tinypipe.planner.estimate.estimate_memory`, devices in order);
    a device's need is what the planner counts against the budget (static pools + activation
    peak + fragmentation + CUDA context, :func:`tinypipe.planner.candidate.gpu_need`), and a kept
    block takes ``tokens * act_bytes_per_token`` (the planner's ``ModelSizes.block_act_bytes`` or a
    profile's) plus the same fragmentation share. A block is counted where its backward runs.
    Conservative: the plan's whole activation peak stays counted though a kept block no longer
    needs its backward working set."""
    needs = []
    for name, cats in memory.devices.items():
        act = cats.get("activations_peak", 0)
        needs.append(memory.device_total(name) + act + int(FRAGMENTATION * act) + GPU_CONTEXT_BYTES)
    recomputes = pack_recomputes(plan)
    bwd = plan.bwd_device or (0,) * plan.num_packs
    per_device = [sum(len(p) for q, p in enumerate(plan.packs) if recomputes[q] and bwd[q] == d)
                  for d in range(len(needs))]
    return keep_limit(needs, per_device, kept_now=plan.num_blocks - recomputed_blocks(plan),
                      bytes_per_block=tokens * act_bytes_per_token * (1.0 + FRAGMENTATION),
                      budget_bytes=budget_bytes)


def plan_offload_limit(events: Sequence[Mapping], step_s: float, *, recompute_s: float, recomputed: int,
                       limit: KeepLimit, d2h_gbs: float, h2d_gbs: float, devices: int) -> OffloadLimit | None:
    """What offloading activations could save in this measured step (:mod:`benchkit.offload_limit`):
    the D2H lanes' busy time inside the forward phase and the H2D lanes' inside the head and
    backward, from the timeline (None: the step has no such phases)."""
    ph = phases(events, step_s)
    if not ph:
        return None
    f0 = ph["fill"]
    h0 = f0 + ph["forward"]
    b1 = h0 + ph["head + backward"]
    transfers = [e for e in events
                 if lane_role(e["lane"]) in ("download", "upload") and e.get("parent") is None]
    merged = lane_busy(transfers)  # lane -> its merged busy intervals, us

    def busy(role: str, lo: float, hi: float) -> float:  # summed over the devices' lanes
        return sum(busy_within([(a / 1e6, b / 1e6) for a, b in iv], lo, hi)
                   for lane, iv in merged.items() if lane_role(lane) == role)

    return OffloadLimit(forward_s=h0 - f0, backward_s=b1 - h0, d2h_busy_forward_s=busy("download", f0, h0),
                        h2d_busy_backward_s=busy("upload", h0, b1), devices=devices,
                        d2h_bytes_per_s=d2h_gbs * 1e9, h2d_bytes_per_s=h2d_gbs * 1e9,
                        bytes_per_block=limit.bytes_per_block, recompute_s=recompute_s,
                        recomputed_blocks=recomputed)

