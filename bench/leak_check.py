#!/usr/bin/env python3
"""Memory drift over many steps: host RSS and CUDA allocated/reserved after every step, a table, and
the slope per step (least squares from step --skip on). Flat memory = no leak.

    python bench/leak_check.py W1 --devices cuda:0 --steps 50 --seq 1024 --batch 8 --json /tmp/out/leak.json
    (defaults: pack size 2, micro-batch 4, window 2, host stash, max_grad_norm 1.0, 24 GiB GPU cap: the
    configuration of bench/RESULTS.md's W1 runs at a quarter of the tokens per step)

Exits 1 when a slope exceeds its bound (--max-rss-slope-mib, --max-cuda-slope-mib, per step).
A CPU smoke run: python bench/leak_check.py tiny --devices cpu --steps 20 --skip 5
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import psutil  # noqa: E402
import torch  # noqa: E402

import tinypipe  # noqa: E402
from benchkit.workloads import WORKLOADS, build_model, make_batch  # noqa: E402
from tinypipe.config import DEVICE_OPTIMIZER_CHOICES  # noqa: E402

MiB = 2**20


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", nargs="?", default="W1", choices=sorted(WORKLOADS))
    ap.add_argument("--devices", default="cuda:0", help="comma-separated, e.g. cuda:0 or cuda:0,cuda:0")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--skip", type=int, default=10, help="slopes are fitted from this step on (warm-up excluded)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per row (W1's own: 2048)")
    ap.add_argument("--batch", type=int, default=8, help="rows per step (W1's own: 16)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--pack-size", type=int, default=2)
    ap.add_argument("--window", type=int, default=2, help="prefetch window")
    ap.add_argument("--stash", default="host")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="<= 0: off")
    ap.add_argument("--device-optimizer", default="off", choices=DEVICE_OPTIMIZER_CHOICES)
    ap.add_argument("--cap-gib", type=float, default=24.0, help="per-process GPU memory cap (GiB); 0 = none")
    ap.add_argument("--batches", type=int, default=4, help="distinct batches cycled through")
    ap.add_argument("--max-rss-slope-mib", type=float, default=1.0, help="host RSS bound, MiB per step")
    ap.add_argument("--max-cuda-slope-mib", type=float, default=1.0, help="CUDA allocated/reserved bound, MiB per step")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def slope(ys: list[float]) -> float:
    """Least-squares slope (sensitive to transient spikes, e.g. a big block freed a step later)."""
    if len(ys) < 2:
        return 0.0
    return statistics.linear_regression(range(len(ys)), ys).slope


def robust_slope(ys: list[float]) -> float:
    """Theil-Sen: the median of all pairwise slopes; transient spikes do not move it. The verdict uses it."""
    pairs = [(ys[j] - ys[i]) / (j - i) for i in range(len(ys)) for j in range(i + 1, len(ys))]
    return statistics.median(pairs) if pairs else 0.0


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    w = WORKLOADS[a.workload]
    w = dataclasses.replace(w, seq=min(a.seq, int(w.config["max_position_embeddings"])), batch=a.batch)
    devices = a.devices.split(",")
    cuda_devs = sorted({d for d in devices if d.startswith("cuda")})
    for dev in cuda_devs:
        if a.cap_gib > 0:
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * 1024**3 / total), torch.device(dev))
    proc = psutil.Process()
    t0 = time.perf_counter()
    model = build_model(w)
    engine = tinypipe.Engine(model, tinypipe.Config(
        devices=devices, micro_batch_size=a.micro_batch, pack_size=a.pack_size, prefetch_window=a.window, stash=a.stash,
        precision=a.precision, lr=1e-5, max_grad_norm=a.max_grad_norm if a.max_grad_norm > 0 else None,
        device_optimizer=a.device_optimizer))
    print(f"{w.name}: {engine.store.param_count / 1e9:.2f} B params, {w.batch} x {w.seq} tokens/step, "
          f"devices {devices}, ready in {time.perf_counter() - t0:.1f} s", flush=True)
    batches = [make_batch(w, seed=i) for i in range(a.batches)]
    rows = []
    print(f"{'step':>4} {'loss':>8} {'s':>6} {'RSS MiB':>9} " + " ".join(
        f"{d + ' alloc':>14} {d + ' resv':>13}" for d in cuda_devs) + f" {'threads':>7}", flush=True)
    for i in range(1, a.steps + 1):
        r = engine.step(batches[i % len(batches)])
        for dev in cuda_devs:
            torch.cuda.synchronize(dev)
        gc.collect()
        row = {"step": i, "loss": r.loss, "seconds": r.seconds, "rss": proc.memory_info().rss,
               "threads": threading.active_count()}
        for dev in cuda_devs:
            row[f"{dev}.allocated"] = torch.cuda.memory_allocated(dev)
            row[f"{dev}.reserved"] = torch.cuda.memory_reserved(dev)
        rows.append(row)
        print(f"{i:>4} {r.loss:>8.4f} {r.seconds:>6.2f} {row['rss'] / MiB:>9.1f} " + " ".join(
            f"{row[f'{d}.allocated'] / MiB:>14.1f} {row[f'{d}.reserved'] / MiB:>13.1f}" for d in cuda_devs)
            + f" {row['threads']:>7}", flush=True)
    tail = rows[a.skip - 1:] if a.skip <= len(rows) else rows
    series = {"rss": a.max_rss_slope_mib}
    for dev in cuda_devs:
        series[f"{dev}.allocated"] = a.max_cuda_slope_mib
        series[f"{dev}.reserved"] = a.max_cuda_slope_mib
    verdict = {}
    print(f"\nslopes per step from step {tail[0]['step']} to {tail[-1]['step']}: Theil-Sen (the verdict) and "
          "least squares; floor = min of the first vs the last 5 samples")
    ok = True
    for key, bound in series.items():
        ys = [row[key] / MiB for row in tail]
        robust, ls = robust_slope(ys), slope(ys)
        floor_first, floor_last = min(ys[:5]), min(ys[-5:])
        good = robust <= bound
        ok &= good
        verdict[key] = {"theil_sen_mib_per_step": robust, "least_squares_mib_per_step": ls, "first_mib": ys[0],
                        "last_mib": ys[-1], "floor_first_mib": floor_first, "floor_last_mib": floor_last,
                        "bound": bound, "ok": good}
        print(f"  {key:<20} {robust * 1024:>8.1f} KiB/step (least squares {ls * 1024:>8.1f}); "
              f"{ys[0]:.1f} -> {ys[-1]:.1f} MiB, floor {floor_first:.1f} -> {floor_last:.1f} MiB; "
              f"bound {bound * 1024:.0f} KiB/step  {'ok' if good else 'DRIFT'}")
    engine.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workload": w.name, "seq": w.seq, "batch": w.batch, "devices": devices, "rows": rows,
                       "slopes": verdict, "torch": torch.__version__, "args": vars(a)}, f, indent=1)
    print("FLAT" if ok else "DRIFT")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
