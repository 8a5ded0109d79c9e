#!/usr/bin/env python3
"""Fit the per-chunk overhead of an assisted round trip (planner/assist.py ``ASSIST_CHUNK_S``) on
one traced clipped run, and check the clipped race with it against that run and others.

    python bench/archive/refit_assist.py --fit bench/results/s8_w1_clip_assist_s8.json \
        --trace bench/results/s8_w1_clip_assist_s8.trace.json [--check other.json ...]

The trace's ``up/f<q>/L<layer>`` spans of the plan's assisted layers (device times, the last
traced step) are each layer's whole round trip on its upload stream. The race times it as the
link time of its bytes (up alone, or up + down over the both-directions rate) plus the device's
AdamW plus one overhead per chunk; the overhead fitted is the median over the assisted blocks of
(measured - link time) / chunks, leaving out the first upload of the step (it also waits for
the step's start). Then each run's plan is raced offline with the fitted value: predicted
forward phase and clipped step against measured (a run without a device-timed decomposition
shows only the step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for benchkit

import transformers  # noqa: E402

import tinypipe.planner.assist as assist  # noqa: E402
import tinypipe.planner.clipped_step as clipped_step  # noqa: E402
from benchkit.workloads import WORKLOADS  # noqa: E402
from tinypipe.memory.device_pool import ASSIST_CHUNK_NUMEL  # noqa: E402
from tinypipe.planner.candidate import evaluate  # noqa: E402
from tinypipe.planner.clipped_step import clipped_race  # noqa: E402
from tinypipe.planner.hardware import load_hardware  # noqa: E402
from tinypipe.planner.sizes import model_sizes  # noqa: E402
from tinypipe.schedule.ids import Kind, TaskId  # noqa: E402
from tinypipe.schedule.plan import Plan  # noqa: E402

def _forward_upload_layer(name: str) -> int | None:
    """The layer of a forward upload span (``up/f<q>/L<layer>``, read back from the trace); None
    for any other span."""
    try:
        tid = TaskId.parse(name)
    except ValueError:
        return None
    return tid.layer if tid.kind is Kind.UPLOAD and tid.phase == "f" else None


def _last_step_uploads(trace: dict) -> dict[int, float]:
    """Seconds of each layer's first upload (``up/f*``) in the trace's last step."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    out: dict[int, float] = {}
    for e in spans:  # a later step's span replaces an earlier one's
        layer = _forward_upload_layer(e["name"])
        if layer is not None:
            out[layer] = e["dur"] / 1e6
    return out


def _overhead(chunk_s: float) -> float:
    """Set ``ASSIST_CHUNK_S`` (and drop the cost model's cached assisted uploads); returns the old."""
    saved, assist.ASSIST_CHUNK_S = assist.ASSIST_CHUNK_S, chunk_s
    clipped_step.assisted_order.cache_clear()
    return saved


def _setup(run: dict, hardware: str):
    w = WORKLOADS[run["workload"]]
    cfg = transformers.LlamaConfig(**w.config)
    plan = Plan.from_json(json.dumps(run["plan"]))
    return w, model_sizes(cfg), plan, load_hardware(hardware)


def fit(run: dict, trace: dict, hardware: str) -> tuple[float, list[dict]]:
    w, sizes, plan, hw = _setup(run, hardware)
    saved = _overhead(0.0)
    try:
        race = clipped_race(sizes, plan, hw, batch=w.batch, seq=w.seq, precision=run["config"]["precision"])
    finally:
        _overhead(saved)
    k = race.kwargs
    measured = _last_step_uploads(trace)
    first = next(u.layer for u in race.uploads if u.up_bytes)
    rows = []
    for u in race.uploads:
        if not u.down_bytes or u.layer not in measured:
            continue
        link = max(u.up_bytes / k["h2d"] + u.device_s, (u.up_bytes + u.down_bytes) / k["bidir"])
        chunks = -(-u.down_bytes // (assist.ASSIST_DOWN_BYTES * ASSIST_CHUNK_NUMEL))
        rows.append({"layer": u.layer, "measured_s": measured[u.layer], "link_s": link, "chunks": chunks,
                     "per_chunk_s": (measured[u.layer] - link) / chunks, "first": u.layer == first})
    fitted = statistics.median(r["per_chunk_s"] for r in rows if not r["first"])
    return fitted, rows


def check(run: dict, hardware: str, chunk_s: float) -> dict:
    w, sizes, plan, hw = _setup(run, hardware)
    saved = _overhead(chunk_s)
    try:
        precision = run["config"]["precision"]
        race = clipped_race(sizes, plan, hw, batch=w.batch, seq=w.seq, precision=precision).run()
        cand = evaluate(sizes, hw, plan, seq=w.seq, global_batch=w.batch, precision=precision, max_grad_norm=1.0)
    finally:
        _overhead(saved)
    dec = run.get("decomposition") or {}
    phases = dec.get("phases", {}) if dec.get("times") == "device" else {}
    return {"predicted_forward_s": race.forward_end_s, "measured_forward_s": phases.get("forward"),
            "predicted_step_s": cand.time.clipped_step_s, "measured_step_s": run["seconds_per_step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", required=True)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--check", nargs="*", default=[])
    ap.add_argument("--hardware", default="h200-pcie5")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    run = json.loads(Path(a.fit).read_text())
    fitted, rows = fit(run, json.loads(Path(a.trace).read_text()), a.hardware)
    print(f"{'layer':>5} {'measured ms':>12} {'link ms':>8} {'chunks':>6} {'ms/chunk':>9}")
    for r in rows:
        note = "  (first upload: not fitted)" if r["first"] else ""
        print(f"{r['layer']:5d} {r['measured_s'] * 1e3:12.1f} {r['link_s'] * 1e3:8.1f} {r['chunks']:6d} "
              f"{r['per_chunk_s'] * 1e3:9.3f}{note}")
    print(f"fitted on {a.fit}: ASSIST_CHUNK_S = {fitted * 1e3:.3f} ms per chunk")
    checks = {}
    print(f"{'run':<48} {'fwd pred':>9} {'fwd meas':>9} {'step pred':>10} {'step meas':>10}")
    for path in [a.fit, *a.check]:
        c = check(json.loads(Path(path).read_text()), a.hardware, fitted)
        checks[path] = c
        fm = f"{c['measured_forward_s']:9.3f}" if c["measured_forward_s"] is not None else f"{'-':>9}"
        print(f"{Path(path).name:<48} {c['predicted_forward_s']:9.3f} {fm} {c['predicted_step_s']:10.3f} "
              f"{c['measured_step_s']:10.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"fit": a.fit, "trace": a.trace, "chunk_s": fitted, "uploads": rows,
                                            "checks": checks}, indent=1))


if __name__ == "__main__":
    main()
