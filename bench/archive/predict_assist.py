"""What the planner predicts for assisted clipped updates (issue #16, ``Plan.assisted``): per
workload the planner's plan and its step without clipping, in a step where clipping triggers with
every leftover update on the host (``assist_updates=False``) and with the GPU assisting some, on
one preset at one GPU budget. ``bench/run.py W1 --auto --max-grad-norm 1.0`` runs the engine's own
plan, which the same search chooses (for the budget the engine reads under its cap); ``--save DIR``
writes the two clipped plans as JSON (``Plan.load``) to run exactly these.

    python bench/archive/predict_assist.py [--workloads W1,W3] [--hardware h200-pcie5] [--gpu-gib 24]
                                   [--adamw-gparams G] [--json]

Rows: unclipped with every update on the host (``assist_updates=False``) and with the planner's
assisted layers (stepped right after their backward; none where the host keeps up), then the
two clipped ones.

Session 7 measured on the H200 (bench/results/s7_*_final.json): W1 unclipped 1.684 s, clipped
1.926 s (predicted 2.012); W3 unclipped 3.292 s, clipped 4.219 s (predicted 4.428).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for benchkit

import transformers  # noqa: E402

from benchkit.workloads import WORKLOADS  # noqa: E402
from tinypipe.planner.hardware import HardwareSpec, load_hardware  # noqa: E402
from tinypipe.planner.search import PlanResult, plan_for  # noqa: E402

GIB = 2**30


def predict(name: str, hardware: HardwareSpec, gpu_gib: float, cpu_gib: float) -> dict:
    """The three plans of workload ``name`` (see the module docstring) and the search times."""
    w = WORKLOADS[name]
    cfg = transformers.LlamaConfig(**w.config)
    kw = dict(gpus=1, gpu_memory_bytes=int(gpu_gib * GIB), cpu_memory_bytes=int(cpu_gib * GIB), seq=w.seq,
              global_batch=w.batch)
    rows = {}
    for label, clip, assist in (("unclipped, host", None, False), ("unclipped", None, True),
                                ("clipped, host", 1.0, False), ("clipped, assisted", 1.0, True)):
        t0 = time.process_time()
        r = plan_for(cfg, hardware, max_grad_norm=clip, assist_updates=assist, **kw)
        rows[label] = _row(r, time.process_time() - t0, w.tokens)
    return {"workload": name, "hardware": hardware.name, "gpu_gib": gpu_gib, "rows": rows}


def _row(r: PlanResult, search_s: float, tokens: int) -> dict:
    t = r.best.time
    sec = r.seconds()
    return {"seconds_per_step": sec, "tokens_per_s": tokens / sec, "unclipped_step_s": t.step_s,
            "clipped_step_s": t.clipped_step_s, "assisted": list(r.best.plan.assisted),
            "gpu_need_gib": r.best.gpu_need / GIB, "describe": r.best.describe(), "search_cpu_s": search_s,
            "plan": r.best.plan.as_dict()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="W1,W3")
    ap.add_argument("--hardware", default="h200-pcie5")
    ap.add_argument("--gpu-gib", type=float, default=24.0)
    ap.add_argument("--cpu-gib", type=float, default=128.0)
    ap.add_argument("--adamw-gparams", type=float, default=None, metavar="G",
                    help="the host AdamW rate instead of the preset's (G params/s): a box with fewer cores")
    ap.add_argument("--save", default=None, metavar="DIR", help="write the clipped plans as JSON here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    hardware = load_hardware(args.hardware)
    if args.adamw_gparams is not None:
        hardware = dataclasses.replace(hardware, cpu_adamw_gparams_s=args.adamw_gparams,
                                       name=f"{hardware.name}, host AdamW {args.adamw_gparams:g} G params/s")
    out = [predict(n.strip(), hardware, args.gpu_gib, args.cpu_gib) for n in args.workloads.split(",")]
    if args.save:
        d = Path(args.save)
        d.mkdir(parents=True, exist_ok=True)
        for res in out:
            for label, row in res["rows"].items():
                if label.startswith("clipped"):
                    tag = "assist" if row["assisted"] else "host"
                    path = d / f"{res['workload'].lower()}_clip_{tag}_plan.json"
                    path.write_text(json.dumps(row["plan"]))
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for res in out:
        print(f"{res['workload']} on {res['hardware']}, {res['gpu_gib']:g} GiB:")
        for label, row in res["rows"].items():
            print(f"  {label:<18} {row['seconds_per_step']:6.3f} s/step {row['tokens_per_s']:>8,.0f} tok/s  "
                  f"GPU {row['gpu_need_gib']:5.1f} GiB  search {row['search_cpu_s']:.2f} s CPU  "
                  f"{row['describe']}")


if __name__ == "__main__":
    main()
