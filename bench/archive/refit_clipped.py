#!/usr/bin/env python3
"""Refit the clipped pass's host AdamW efficiency (planner/clipped_step.py ``CLIPPED_ADAMW_EFFICIENCY``) on
measured clipped runs and check it on others it was not fitted on.

    python bench/archive/refit_clipped.py --fit bench/results/s7_w1_clip_after.json [more fit runs] \
        --check bench/results/s7_w3_clip_after.json bench/results/s5_w1_clip_resident4.json

Each file is a ``bench/run.py --json`` result of a clipped run; its plan is evaluated offline
with the hardware preset of its GPU (``--hardware``), for each efficiency, and the one that
predicts the fit runs' median measured / predicted step exactly is reported (with one fit run:
its step), with every run's errors.
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

import tinypipe.planner.clipped_step as clipped_step  # noqa: E402
from benchkit.workloads import WORKLOADS  # noqa: E402
from tinypipe.planner.candidate import evaluate  # noqa: E402
from tinypipe.planner.hardware import load_hardware  # noqa: E402
from tinypipe.planner.sizes import model_sizes  # noqa: E402
from tinypipe.schedule.plan import Plan  # noqa: E402


def predicted(run: dict, hardware: str, efficiency: float) -> float:
    w = WORKLOADS[run["workload"]]
    cfg = transformers.LlamaConfig(**w.config)
    plan = Plan.from_json(json.dumps(run["plan"]))
    clipped_step.CLIPPED_ADAMW_EFFICIENCY = efficiency
    cand = evaluate(model_sizes(cfg), load_hardware(hardware), plan, seq=w.seq, global_batch=w.batch,
                    precision=run["config"]["precision"], max_grad_norm=1.0)
    return cand.time.clipped_step_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", nargs="+", required=True)
    ap.add_argument("--check", nargs="*", default=[])
    ap.add_argument("--hardware", default="h200-pcie5")
    a = ap.parse_args()
    old = clipped_step.CLIPPED_ADAMW_EFFICIENCY  # the value in the code, before the fit moves it
    fits = [json.loads(Path(p).read_text()) for p in a.fit]

    def median_error(efficiency: float) -> float:
        return statistics.median(predicted(r, a.hardware, efficiency) / r["seconds_per_step"] - 1 for r in fits)

    lo, hi = 0.2, 1.5
    for _ in range(40):  # the prediction falls as the efficiency rises
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if median_error(mid) > 0 else (lo, mid)
    eff = (lo + hi) / 2
    print(f"fitted on {len(fits)} run(s): efficiency {eff:.3f} (in the code: {old:.3f})")
    print(f"{'run':<48} {'measured':>9} {'old pred':>9} {'new pred':>9} {'err':>7}")
    for path in [*a.fit, *a.check]:
        run = json.loads(Path(path).read_text())
        m, p_old, p_new = run["seconds_per_step"], predicted(run, a.hardware, old), predicted(run, a.hardware, eff)
        print(f"{Path(path).name:<48} {m:>9.3f} {p_old:>9.3f} {p_new:>9.3f} {100 * (p_new / m - 1):>+6.1f}%")


if __name__ == "__main__":
    main()
