"""Human-readable dumps of a schedule and Chrome/Perfetto traces of a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tinypipe.schedule.tasks import Schedule


def to_text(sched: Schedule) -> str:
    """One block per lane, one line per task: id, layers, rows, slots and dependencies (lanes in
    the order of their names)."""
    p = sched.plan
    lines = [
        f"schedule: batch={sched.batch} packs={[list(x) for x in p.packs]} fwd_mb={p.micro_batch_size} "
        f"bwd_mb={p.backward_micro_batch_size} devices={p.num_devices} window={p.prefetch_window} "
        f"slots/device={p.param_slots()} grad_slots/device={p.grad_slot_count()}"
    ]
    for lane in sorted(sched.lanes, key=str):
        lines.append(f"[{lane}]")
        for tid in sched.lanes[lane]:
            t = sched.tasks[tid]
            extra = []
            if t.rows != (0, 0):
                extra.append(f"rows={t.rows[0]}:{t.rows[1]}")
            if t.slots:
                extra.append(f"slots={list(t.slots)}")
            if t.grad_slots:
                extra.append(f"gslots={list(t.grad_slots)}")
            deps = f" after {', '.join(map(str, t.deps))}" if t.deps else ""
            lines.append(f"  {str(t.id):<16} layers={list(t.layers)} {' '.join(extra)}{deps}")
    return "\n".join(lines)


def chrome_trace(events: Iterable[dict], path: str | Path) -> Path:
    """Write ``events`` (dicts with lane, name, start_us, dur_us, args) as a Chrome trace JSON.

    Open it in Perfetto (ui.perfetto.dev) or chrome://tracing: one row per lane (device stream
    or host worker), so bubbles and overlap are visible at a glance.
    """
    events = list(events)
    lanes = sorted({e["lane"] for e in events})
    tid = {lane: i for i, lane in enumerate(lanes)}
    out = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": tid[l], "args": {"name": l}} for l in lanes]
    for e in events:
        out.append({
            "ph": "X", "pid": 0, "tid": tid[e["lane"]], "name": e["name"],
            "ts": round(e["start_us"], 3), "dur": round(max(e["dur_us"], 0.001), 3),
            "args": e.get("args", {}),
        })
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))
    return path
