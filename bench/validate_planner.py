#!/usr/bin/env python3
"""Check the planner against measurements: predicted vs measured step time and peak GPU memory
for several plans of one workload, and the packing comparison (the planner's plan vs uniform
1-layer packs vs a Mobius-like split into 4 equal stages with window 1, same budget).

    python bench/validate_planner.py                       # W1 on cuda:0 under a 24 GiB cap (~5 min)
    python bench/validate_planner.py --workload tiny --device cpu   # the same logic on the CPU, seconds

The model is built once and reused: each plan gets a fresh Engine (which re-points the model's
parameters into its own host store); the previous engine is closed and dropped first. Every plan
runs ``--warmup`` + ``--steps`` optimizer steps on the same batch. Prints a markdown table last;
writes JSON to ``--json FILE`` or, if ``$OUT`` is set, ``$OUT/validate_planner.json``.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import transformers  # noqa: E402

import tinypipe  # noqa: E402
from benchkit.rss import RssSampler  # noqa: E402
from benchkit.workloads import WORKLOADS, build_model, make_batch  # noqa: E402
from tinypipe.config import STASH_PLACES  # noqa: E402
from tinypipe.errors import TinypipeError  # noqa: E402
from tinypipe.planner.auto import CPU_HARDWARE  # noqa: E402
from tinypipe.planner.hardware import load_hardware  # noqa: E402
from tinypipe.planner.search import Candidate, evaluate, plan_for  # noqa: E402
from tinypipe.planner.sizes import model_sizes  # noqa: E402
from tinypipe.schedule.plan import make_plan  # noqa: E402
from tinypipe.units import parse_bytes  # noqa: E402

GIB = 1024**3


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="W1", choices=sorted(WORKLOADS))
    ap.add_argument("--device", default=None, help="cuda:0 (default when CUDA is available) or cpu")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap and plan budget (GiB)")
    ap.add_argument("--cpu-memory", default=None, help="host budget, e.g. 100GiB (default: available RAM)")
    ap.add_argument("--hardware", default=None, help="preset or profile JSON (default: h200-pcie5 on CUDA)")
    ap.add_argument("--compare-hardware", default=None,
                    help="second hardware (e.g. a 'tinypipe profile' JSON): its predictions for the same "
                         "plans too")
    ap.add_argument("--precision", default=None, help="bf16 (CUDA default) or fp32 (CPU default)")
    ap.add_argument("--plans", type=int, default=3,
                    help="plans to validate (the planner's choice + Pareto points)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--no-comparison", action="store_true", help="skip uniform-1 / Mobius-like runs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--watchdog", type=float, default=570.0, help="dump stacks and exit after S s (0: off)")
    return ap.parse_args(argv)


def _stage(num_blocks: int) -> int:
    """Blocks per stage of the Mobius-like split: 4 equal stages (at least 2 blocks each)."""
    return min(num_blocks, max(2, math.ceil(num_blocks / 4)))


def _key(c: Candidate) -> str:
    return json.dumps(c.plan.settings(), sort_keys=True)


def grid(sizes, hw, *, seq: int, batch: int, precision: str, gpu: int, host: int) -> list[Candidate]:
    """A small grid of plans (uniform packs, equal micro-batches), all evaluated; fitting ones."""
    L = sizes.num_blocks
    stage = _stage(L)
    packs = sorted({1, 2, 4, stage} & set(range(1, L + 1)))
    mbs = sorted({m for m in (1, 2, 4, 8, 16) if m <= batch})
    out = []
    for pack in packs:
        for mb in mbs:
            for stash in STASH_PLACES:
                if stash == "host" and -(-L // pack) < 2:
                    continue
                for w in (1, 2):
                    if w > pack and w > 1:
                        continue
                    plan = make_plan(L, pack_size=pack, micro_batch_size=mb, backward_micro_batch_size=mb,
                                     num_devices=1, prefetch_window=w, stash=stash, tied=sizes.tied)
                    c = evaluate(sizes, hw, plan, seq=seq, global_batch=batch, precision=precision)
                    if c.gpu_need <= gpu and c.host_need <= host:
                        out.append(c)
    return out


def choose(result, extra: list[Candidate], n: int) -> list[tuple[str, Candidate]]:
    """The planner's choice plus n-1 others from the Pareto front (spread from fast to lean), then
    from the grid, each with settings different from those already taken."""
    picked = [("planner", result.best)]
    seen = {_key(result.best)}
    front = [c for c in result.pareto if _key(c) not in seen]
    order = []
    if front:
        order += [front[0], front[-1]] + front  # the fastest other, the leanest, then the rest
    order += sorted(extra, key=lambda c: c.time.step_s)
    for c in order:
        if len(picked) >= n:
            break
        if _key(c) in seen:
            continue
        seen.add(_key(c))
        picked.append((f"pareto-{len(picked)}" if c in result.pareto else f"grid-{len(picked)}", c))
    return picked


def run_plan(model, batch, devices, precision, cand: Candidate, warmup: int, steps: int, cuda: bool,
             rss: RssSampler):
    """Build an engine that runs ``cand``'s plan, run warm-up + timed steps, return measurements."""
    cfg = tinypipe.Config(devices=devices, precision=precision, lr=1e-5, max_grad_norm=None)
    out: dict = {"settings": cand.plan.settings(), "describe": cand.describe()}
    engine = None
    try:
        t0 = time.perf_counter()
        engine = tinypipe.Engine(model, cfg, plan=cand.plan)
        out["engine_init_s"] = time.perf_counter() - t0
        secs, losses = [], []
        for i in range(warmup + steps):
            if cuda and i == warmup:
                torch.cuda.reset_peak_memory_stats(devices[0])
            r = engine.step(batch)
            losses.append(r.loss)
            if i >= warmup:
                secs.append(r.seconds)
            note = "  (warm-up)" if i < warmup else ""
            print(f"    step {i + 1}: {r.seconds:.3f} s  loss {r.loss:.4f}{note}", flush=True)
        out["steps_s"] = secs
        out["step_s"] = sum(secs) / len(secs)
        out["tokens_per_s"] = batch["input_ids"].numel() / out["step_s"]
        out["losses"] = losses
        rep = engine.memory_report()
        name = next(iter(rep.devices))
        out["measured_activations_peak"] = rep.devices[name].get("activations_peak")
        out["measured_static"] = sum(v for k2, v in rep.devices[name].items() if k2 != "activations_peak")
        if cuda:
            out["peak_allocated"] = torch.cuda.max_memory_allocated(devices[0])
            out["peak_reserved"] = torch.cuda.max_memory_reserved(devices[0])
        out["host_rss_peak"] = rss.peak
    except (TinypipeError, RuntimeError,
            torch.OutOfMemoryError) as exc:  # record and go on with the next plan
        out["error"] = " ".join(str(exc).split())[:400]
        print(f"    FAILED: {out['error']}", flush=True)
        traceback.print_exc()
    finally:
        if engine is not None:
            engine.close()
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return out


def predicted(c: Candidate) -> dict:
    mem = c.memory
    name = next(iter(mem.devices))
    act = mem.devices[name].get("activations_peak", 0)
    return {"step_s": c.time.step_s, "tokens_per_s": c.time.tokens_per_s, "static": mem.device_total(name),
            "activations_peak": act, "peak_allocated": mem.device_total(name) + act, "gpu_need": c.gpu_need,
            "host_need": c.host_need, "time": c.time.as_dict()}


def pct(pred: float | None, meas: float | None) -> str:
    if not pred or not meas:
        return "n/a"
    return f"{(pred - meas) / meas * 100:+.1f}%"


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.watchdog > 0:
        faulthandler.dump_traceback_later(a.watchdog, exit=True)
    t_start = time.perf_counter()
    w = WORKLOADS[a.workload]
    device = a.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    precision = a.precision or ("bf16" if cuda else "fp32")
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * GIB / total), torch.device(device))
        hw = load_hardware(a.hardware or "h200-pcie5")
    else:
        hw = load_hardware(a.hardware) if a.hardware else CPU_HARDWARE
    gpu_budget = int(a.cap_gib * GIB)
    if a.cpu_memory:
        host_budget = parse_bytes(a.cpu_memory)
    else:
        import psutil

        host_budget = int(psutil.virtual_memory().available)
    cfg = transformers.LlamaConfig(**w.config)
    print(f"[{time.perf_counter() - t_start:6.1f} s] planning {w.name} ({w.batch} x {w.seq}, {precision}) on "
          f"{device} ({hw.name}), GPU budget {gpu_budget / GIB:.1f} GiB, host {host_budget / GIB:.1f} GiB",
          flush=True)
    result = plan_for(cfg, hw, gpus=1, gpu_memory_bytes=gpu_budget, cpu_memory_bytes=host_budget, seq=w.seq,
                      global_batch=w.batch, precision=precision)
    sizes = model_sizes(cfg)
    fits = grid(sizes, hw, seq=w.seq, batch=w.batch, precision=precision, gpu=gpu_budget, host=host_budget)
    runs = choose(result, fits, a.plans)
    if not a.no_comparison:
        L = sizes.num_blocks
        stage = _stage(L)
        uniform = [c for c in fits if c.plan.pack_size == 1]
        mobius = [c for c in fits if c.plan.pack_size == stage and c.plan.prefetch_window == 1]
        for label, pool in (("uniform-1", uniform), (f"mobius-{-(-L // stage)}x{stage}", mobius)):
            if pool:
                runs.append((label, min(pool, key=lambda c: c.time.step_s)))
            else:
                print(f"  {label}: no plan of that shape fits the budget", flush=True)
    for label, c in runs:
        print(f"  {label:<14} predicted {c.time.step_s:7.3f} s/step {c.tokens_per_s:>10,.0f} tok/s  "
              f"GPU need {c.gpu_need / GIB:6.2f} GiB  {c.describe()}", flush=True)

    hw2 = load_hardware(a.compare_hardware) if a.compare_hardware else None

    def predict2(c: Candidate) -> float | None:
        if hw2 is None:
            return None
        return evaluate(sizes, hw2, c.plan, seq=w.seq, global_batch=w.batch, precision=precision).time.step_s

    devices = [device]
    batch = make_batch(w)
    rows = []
    measured_by_key: dict[str, dict] = {}
    with RssSampler() as rss:
        t0 = time.perf_counter()
        model = build_model(w)
        print(f"[{time.perf_counter() - t_start:6.1f} s] model built ({time.perf_counter() - t0:.1f} s)",
              flush=True)
        for label, c in runs:
            key = _key(c)
            print(f"[{time.perf_counter() - t_start:6.1f} s] {label}: {c.describe()}", flush=True)
            if key in measured_by_key:  # the comparison's plan may be one already measured
                m = measured_by_key[key]
                print("    (measured above)", flush=True)
            else:
                m = run_plan(model, batch, devices, precision, c, a.warmup, a.steps, cuda, rss)
                measured_by_key[key] = m
            rows.append({"label": label, "predicted": predicted(c), "measured": m,
                         "predicted_compare_step_s": predict2(c)})

    # ------------------------------------------------------------------ report
    out = {"workload": w.name, "device": device,
           "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
           "precision": precision, "hardware": hw.as_dict(), "gpu_budget_bytes": gpu_budget,
           "host_budget_bytes": host_budget, "warmup": a.warmup, "steps": a.steps, "torch": torch.__version__,
           "compare_hardware": hw2.as_dict() if hw2 is not None else None,
           "planner_best": result.best.describe(), "rows": rows, "seconds": time.perf_counter() - t_start}
    path = a.json or (os.path.join(os.environ["OUT"],
                                   "validate_planner.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {path}")
    print(f"\n=== planner validation: {w.name} ({w.batch} x {w.seq}, {precision}) on {out['device_name']}, "
          f"budget {gpu_budget / GIB:.0f} GiB ===")
    print("| plan | settings | pred s/step | meas s/step | err | pred tok/s | meas tok/s | pred peak alloc "
          "| meas peak alloc | err | pred need (w/ headroom) | meas peak reserved | err | pred act "
          "| meas act |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p, m = r["predicted"], r["measured"]
        if "error" in m:
            print(f"| {r['label']} | {m['describe']} | {p['step_s']:.3f} | FAILED: {m['error'][:80]} |"
                  + " |" * 11)
            continue
        g = lambda b: f"{b / GIB:.2f} GiB" if b else "n/a"  # noqa: E731
        print(f"| {r['label']} | {m['describe']} | {p['step_s']:.3f} | {m['step_s']:.3f} | "
              f"{pct(p['step_s'], m['step_s'])} | {p['tokens_per_s']:,.0f} | {m['tokens_per_s']:,.0f} | "
              f"{g(p['peak_allocated'])} | {g(m.get('peak_allocated'))} | "
              f"{pct(p['peak_allocated'], m.get('peak_allocated'))} | {g(p['gpu_need'])} | "
              f"{g(m.get('peak_reserved'))} | {pct(p['gpu_need'], m.get('peak_reserved'))} | "
              f"{g(p['activations_peak'])} | {g(m.get('measured_activations_peak'))} |")
    if hw2 is not None:
        print(f"\nwith --compare-hardware {hw2.name}:")
        print("| plan | pred s/step | meas s/step | err |")
        print("|---|---|---|---|")
        for r in rows:
            m, p2 = r["measured"], r["predicted_compare_step_s"]
            if "error" not in m:
                print(f"| {r['label']} | {p2:.3f} | {m['step_s']:.3f} | {pct(p2, m['step_s'])} |")
    return 0 if all("error" not in r["measured"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
