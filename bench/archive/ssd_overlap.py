"""Does SSD I/O overlap with the CPU AdamW step? The optimizer path's loop, timed three ways.

Usage: ``python bench/archive/ssd_overlap.py DIR [--layers 8] [--mib 64] [--depth 2] [--reps 3] [--json OUT]``

Per layer: master, exp_avg, exp_avg_sq of ``--mib`` MiB each live on the SSD; a step reads them
ahead (``--depth`` layers in flight through a StagingPool of depth + 1 layers), runs AdamW on the
staging buffers and writes them back asynchronously. Timed: the loop without the AdamW (I/O only),
the AdamW alone on DRAM tensors (compute only), and the full loop. Perfect overlap is
full = max(io, compute).

Measured on the CPU machine (2 cores shared with two other busy processes, load 6; 8 layers x 3 x
64 MiB, depth 2; ``bench/results/ssd_overlap_cpu.json``): io 0.85-1.20 s (2.7-3.8 GB/s read +
write), compute 1.4-2.3 s, full 2.3-2.6 s = 1.08-1.60x the bound, median 1.22. Timed inside the
full loop (3 more runs), waiting for reads was 0.10-0.36 s of 1.7-2.5 s, including the first
``depth`` layers' reads that nothing can hide; the rest of the residue is CPU contention.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from tinypipe.devices.host_buffers import aligned_empty  # noqa: E402
from tinypipe.storage import SsdStateStore, StagingPool, StateStager  # noqa: E402

KINDS = ("master", "exp_avg", "exp_avg_sq")


def adamw(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, step: int) -> None:
    torch._foreach_mul_([p], 1 - 1e-3 * 0.01)
    m.lerp_(g, 0.1)
    v.mul_(0.999).addcmul_(g, g, value=0.001)
    p.addcdiv_(m, (v / (1 - 0.999**step)).sqrt_().add_(1e-8), value=-1e-3 / (1 - 0.9**step))


def loop(stager: StateStager, layers: int, n: int, depth: int, grad: torch.Tensor, step: int,
         compute: bool) -> float:
    keys = {l: [(l, k) for k in KINDS] for l in range(layers)}
    t0 = time.perf_counter()
    ahead = {l: stager.stage(keys[l]) for l in range(min(depth, layers))}
    writes = []
    for l in range(layers):
        staged = ahead.pop(l)
        slots = staged.wait()
        if compute:
            adamw(*(slots[k].view(torch.float32, n) for k in keys[l]), grad, step)
        writes += staged.write_back()
        if l + depth < layers:
            ahead[l + depth] = stager.stage(keys[l + depth])
    stager.store.wait(writes)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n = (args.mib << 20) // 4
    regions = {(l, k): n * 4 for l in range(args.layers) for k in KINDS}
    pool = StagingPool(3 * (args.depth + 1), n * 4)  # + the layer whose write-back is landing
    grad = torch.randn(n)
    # realistic values on both sides: a negative second moment would make sqrt NaN, and NaN
    # arithmetic runs ~2.5x slower on this CPU (measured), which would fake a slow loop
    dram = [torch.randn(n), torch.randn(n), torch.randn(n).square_()]
    extra = {} if args.threads is None else {"threads": args.threads}
    rows = []
    with SsdStateStore(args.directory, regions, **extra) as store:
        init, square = aligned_empty(n), aligned_empty(n)
        init.normal_()
        torch.square(init, out=square)
        store.wait([store.write_async(k, square if k[1] == "exp_avg_sq" else init) for k in regions])
        stager = StateStager(store, pool)
        for rep in range(args.reps):
            io = loop(stager, args.layers, n, args.depth, grad, rep + 1, compute=False)
            t0 = time.perf_counter()
            for _ in range(args.layers):
                adamw(*dram, grad, rep + 1)
            compute = time.perf_counter() - t0
            full = loop(stager, args.layers, n, args.depth, grad, rep + 1, compute=True)
            moved = 2 * len(regions) * n * 4
            row = {"rep": rep, "io_s": io, "compute_s": compute, "full_s": full,
                   "bound_s": max(io, compute), "io_gbps": moved / io / 1e9, "threads": store.threads}
            rows.append(row)
            print(f"rep {rep}: io {io:.2f} s ({row['io_gbps']:.2f} GB/s r+w), compute {compute:.2f} s, "
                  f"full {full:.2f} s = {full / row['bound_s']:.2f} x max(io, compute)", flush=True)
    ratio = statistics.median(r["full_s"] / r["bound_s"] for r in rows)
    print(f"median full / max(io, compute): {ratio:.2f} (host staging {pool.nbytes >> 20} MiB)")
    if args.json:
        meta = {"layers": args.layers, "mib": args.mib, "depth": args.depth,
                "torch_threads": torch.get_num_threads()}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
