#!/usr/bin/env python3
"""The host-DRAM floor on the forward after a clipped step (planner/dram.py) against measured steps.

    python bench/archive/dram_window.py bench/results/s9_w3_clip_s9.json bench/results/s9_w1_clip_s9.json ...
        [--dram-gbs G (default: the h200-pcie5 preset's host_dram_gbs)] [--json out.json]

Each file is a ``bench/run.py --json`` result of a clipped run; its plan's bytes through host
memory in the forward after a clipped step (host pass, uploads, assisted round trips, stashed
activations) over the DRAM rate is the floor, printed beside the run's measured forward phase
(device times where the run was traced, else host times) and the unclipped forward it would have
without clipping. The rate is not
fitted on these runs: it comes from two benchmarks of the host pass beside link traffic.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for benchkit

import transformers  # noqa: E402

from benchkit.workloads import WORKLOADS  # noqa: E402
from tinypipe.planner.work import UPLOAD_BYTES  # noqa: E402
from tinypipe.planner.dram import clipped_forward_dram  # noqa: E402
from tinypipe.planner.hardware import load_hardware  # noqa: E402
from tinypipe.planner.sizes import model_sizes  # noqa: E402
from tinypipe.schedule.plan import Plan  # noqa: E402


def row(path: str, dram_gbs: float) -> dict:
    run = json.loads(Path(path).read_text())
    w = WORKLOADS[run["workload"]]
    sizes = model_sizes(transformers.LlamaConfig(**w.config))
    plan = Plan.from_json(json.dumps(run["plan"]))
    act = 2 if run["config"]["precision"] == "bf16" else 4
    win = clipped_forward_dram(sizes, plan, stash_bytes=w.tokens * sizes.hidden * act, upload_bytes=UPLOAD_BYTES)
    dec = run.get("decomposition") or {}
    return {"run": Path(path).name, "workload": run["workload"], "assisted_layers": len(plan.assisted),
            "host_stepped": win.host_stepped, "assisted": win.assisted, "dram_bytes": win.bytes,
            "floor_s": win.seconds(dram_gbs), "forward_s": dec.get("phases", {}).get("forward"),
            "times": dec.get("times"), "step_s": run["seconds_per_step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--dram-gbs", type=float, default=load_hardware("h200-pcie5").host_dram_gbs)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = [row(p, a.dram_gbs) for p in a.runs]
    print(f"host DRAM at {a.dram_gbs:g} GB/s")
    print(f"{'run':<30} {'assisted':>8} {'host G':>7} {'GPU G':>6} {'DRAM GB':>8} {'floor s':>8} "
          f"{'forward s':>10} {'times':>6} {'step s':>7}")
    for r in rows:
        fwd = f"{r['forward_s']:10.3f}" if r["forward_s"] is not None else f"{'-':>10}"
        print(f"{r['run']:<30} {r['assisted_layers']:8d} {r['host_stepped'] / 1e9:7.2f} {r['assisted'] / 1e9:6.2f} "
              f"{r['dram_bytes'] / 1e9:8.1f} {r['floor_s']:8.3f} {fwd} {r['times'] or '-':>6} {r['step_s']:7.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"dram_gbs": a.dram_gbs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
