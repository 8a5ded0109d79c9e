"""The host AdamW's rate inside a step: the median block update's G params/s while the backward
runs, and after it, from traced runs (``bench/run.py --trace``), against ``cpu_adamw_gparams_s``
(the rate measured alone; planner/cost.py's backward term says why the planner still uses that).

    python bench/archive/adamw_in_pipeline.py bench/results/s7_w1_final.trace.json [more traces]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for benchkit

from benchkit.workloads import WORKLOADS  # noqa: E402
from tinypipe.planner.sizes import model_sizes  # noqa: E402
from tinypipe.schedule.ids import OPTIMIZER_LANE, Kind, Lane, TaskId  # noqa: E402


def _task(lane: str, name: str) -> tuple[Lane, TaskId] | None:
    """A span's lane and task, read back from the trace's text; None for other spans (SSD lanes,
    sub-spans, a clipped step's leftover updates)."""
    try:
        return Lane.parse(lane), TaskId.parse(name)
    except ValueError:
        return None


def rates(trace: Path, block_params: int) -> dict:
    """Median block-update rates (G params/s) during and after the traced step's backward."""
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    spans = [(e, _task(lanes[e["tid"]], e["name"])) for e in events if e["ph"] == "X"]
    tasks = [(e, t) for e, t in spans if t is not None]
    bwd = [e for e, (lane, tid) in tasks if lane.name == "compute" and tid.kind is Kind.BWD]
    end = max(e["ts"] + e["dur"] for e in bwd)
    upd = [(e, tid.layer or 0) for e, (lane, tid) in tasks
           if lane == OPTIMIZER_LANE and tid.kind is Kind.UPDATE]
    last = max(layer for _, layer in upd)
    blocks = [e for e, layer in upd if 0 < layer < last]  # not the embedding, not the head
    during = [e["dur"] for e in blocks if e["ts"] + e["dur"] <= end]
    after = [e["dur"] for e in blocks if e["ts"] >= end]

    def rate(durs: list[float]) -> float | None:
        return block_params / (statistics.median(durs) * 1e-6) / 1e9 if durs else None

    return {"trace": trace.name, "blocks_during": len(during), "gparams_s_during": rate(during),
            "blocks_after": len(after), "gparams_s_after": rate(after)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--workload", default=None, help="W1 or W3 (default: from the file name)")
    a = ap.parse_args()
    for t in a.traces:
        name = a.workload or ("W3" if "w3" in t.name.lower() else "W1")
        sizes = model_sizes(transformers.LlamaConfig(**WORKLOADS[name].config))
        r = rates(t, sizes.layer_train_numels[1])
        print(f"{r['trace']}: {name}, {r['blocks_during']} block updates during the backward at "
              f"{r['gparams_s_during']:.2f} G params/s (median), {r['blocks_after']} after"
              + ("" if r["gparams_s_after"] is None else f" at {r['gparams_s_after']:.2f}"))


if __name__ == "__main__":
    main()
