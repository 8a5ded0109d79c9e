#!/usr/bin/env python3
"""Refit the forward's rate per FLOP relative to the backward's (planner/work.py
``FORWARD_RATE_FACTOR``) on traced runs' measured forward and recompute compute, check it on traced
runs it was not fitted on, and print every run's step-time error at ``--baseline`` (default 1: one
rate for every pass, the model before session 15) and at the refitted factor.

    python bench/archive/refit_compute.py --fit s11_w1_turn_traced_s11.json s12_w1_turn_s12b.json ... \
        --check-parts s11_w3_turn_traced_s11c.json ... --check-steps s14_w1_*.json ...

Files are ``bench/run.py --json`` results (names relative to bench/results/). A traced run's
``decomposition.parts`` holds the compute lanes' seconds per kind of work (CUDA events); its plan is
evaluated offline on the hardware preset (``--hardware``). The fitted factor makes the fit runs'
median measured / predicted forward-and-recompute ratio 1; the backward's ratio is printed beside
(the factor assumes the backward sits on the hardware's rate).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for benchkit

import transformers  # noqa: E402

import tinypipe.planner.work as work  # noqa: E402
from benchkit.workloads import WORKLOADS  # noqa: E402
from tinypipe.planner.candidate import evaluate  # noqa: E402
from tinypipe.planner.hardware import load_hardware  # noqa: E402
from tinypipe.planner.sizes import model_sizes  # noqa: E402
from tinypipe.schedule.plan import Plan  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"


@contextmanager
def forward_rate_factor(value: float) -> Iterator[None]:
    """``work.FORWARD_RATE_FACTOR`` set to ``value`` inside the block, restored after it."""
    saved = work.FORWARD_RATE_FACTOR
    work.FORWARD_RATE_FACTOR = value
    try:
        yield
    finally:
        work.FORWARD_RATE_FACTOR = saved


def _sizes_plan(run: dict):
    w = WORKLOADS[run["workload"]]
    return w, model_sizes(transformers.LlamaConfig(**w.config)), Plan.from_json(json.dumps(run["plan"]))


def pass_seconds(run: dict, hardware: str) -> dict[str, float]:
    """The model's compute seconds of ``run``'s plan at one rate (factor 1): forward, recompute
    and backward, summed over packs -- the terms ``work.pack_work`` puts on the compute lane."""
    w, sizes, plan = _sizes_plan(run)
    with forward_rate_factor(1.0):
        plan_work = work.Work.of(sizes, plan, load_hardware(hardware), batch=w.batch, seq=w.seq,
                                 precision=run["config"]["precision"])
    f, r = plan_work.fwd_flops, plan_work.rates
    kept = [plan.kept(q) for q in range(plan.num_packs)]
    return {"forward": sum(f) / r.forward,
            "recompute": sum(x for x, k in zip(f, kept) if not k) / r.recompute,
            "backward": sum(2 * x / (r.kept_backward if k else r.backward) for x, k in zip(f, kept))}


def ratios(run: dict, hardware: str) -> dict[str, float]:
    """Measured / modelled (factor 1) compute seconds per kind of work."""
    model, parts = pass_seconds(run, hardware), run["decomposition"]["parts"]
    return {k: parts[k] / model[k] for k in model if model[k] > 0}


def step_predicted(run: dict, hardware: str, factor: float) -> float:
    w, sizes, plan = _sizes_plan(run)
    with forward_rate_factor(factor):
        cand = evaluate(sizes, load_hardware(hardware), plan, seq=w.seq, global_batch=w.batch,
                        precision=run["config"]["precision"])
    return cand.time.step_s


def traced(run: dict) -> bool:
    return (run.get("decomposition") or {}).get("times") == "device" and "plan" in run


def unclipped_default(run: dict) -> bool:
    """What the plain step prediction is for: unclipped, one GPU, the default host threads."""
    c = run.get("config", {})
    return ("plan" in run and not run.get("clipping") and len(run["devices"]) == 1
            and c.get("optimizer_threads") in (None, "None"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", nargs="+", required=True, help="traced runs to fit on")
    ap.add_argument("--check-parts", nargs="*", default=[], help="traced runs to check the parts on")
    ap.add_argument("--check-steps", nargs="*", default=[], help="runs whose step times to compare")
    ap.add_argument("--hardware", default="h200-pcie5")
    ap.add_argument("--baseline", type=float, default=1.0,
                    help="the factor to compare the step times against (default 1: one rate, the model "
                         "before session 15)")
    a = ap.parse_args()
    load = {p: json.loads((RESULTS / p).read_text()) for p in {*a.fit, *a.check_parts, *a.check_steps}}
    bad = [p for p in [*a.fit, *a.check_parts] if not traced(load[p])]
    if bad:
        raise SystemExit(f"not traced (decomposition.times != device): {', '.join(bad)}")
    fit_r = {p: ratios(load[p], a.hardware) for p in a.fit}
    fwd = [r[k] for r in fit_r.values() for k in ("forward", "recompute")]
    factor = 1.0 / statistics.median(fwd)
    old = work.FORWARD_RATE_FACTOR
    print(f"fitted on {len(a.fit)} traced runs: FORWARD_RATE_FACTOR {factor:.3f} (in the code: {old:.3f})")
    print(f"{'set':<6} {'run':<34} {'fwd meas/model':>15} {'rec':>6} {'bwd':>6}   (model at factor 1)")
    for group, paths in (("fit", a.fit), ("check", a.check_parts)):
        for p in paths:
            r = fit_r.get(p) or ratios(load[p], a.hardware)
            print(f"{group:<6} {p:<34} {r['forward']:>15.3f} {r.get('recompute', float('nan')):>6.3f} "
                  f"{r['backward']:>6.3f}")
    steps = [p for p in a.check_steps if unclipped_default(load[p])]
    print(f"\nstep times ({len(steps)} unclipped one-GPU runs at the default threads; "
          f"{len(a.check_steps) - len(steps)} others skipped)")
    base = a.baseline
    heads = [f"pred {x:.3f}" for x in (base, factor)]
    print(f"{'run':<34} {'measured':>9} {heads[0]:>11} {heads[1]:>11} {'err':>7} {'err':>7}")
    errs: dict[float, list[float]] = {base: [], factor: []}
    for p in steps:
        m = load[p]["seconds_per_step"]
        po, pn = step_predicted(load[p], a.hardware, base), step_predicted(load[p], a.hardware, factor)
        errs[base].append(po / m - 1)
        errs[factor].append(pn / m - 1)
        print(f"{p:<34} {m:>9.3f} {po:>11.3f} {pn:>11.3f} "
              f"{100 * (po / m - 1):>+6.1f}% {100 * (pn / m - 1):>+6.1f}%")
    for f, e in errs.items():
        if e:
            print(f"factor {f:.3f}: median step error {100 * statistics.median(e):+.1f}%, "
                  f"largest {100 * max(e, key=abs):+.1f}% over {len(e)} runs")


if __name__ == "__main__":
    main()
