#!/usr/bin/env python3
"""Time a clipped step's deferred host AdamW pass over one layer: the clip coefficient as a separate
``g.mul_(coef)`` pass (before) vs passed into torch's fused kernel as ``grad_scale`` (after).

    python bench/archive/clip_bench.py --numel 100669440 --threads 1,2 --json out.json

Both run chunk by chunk as :meth:`tinypipe.runtime.optim.decisions.StepDecisions._redo` does
(``REDO_CHUNK`` elements, torch's fused CPU AdamW through :class:`ChunkedAdamW`); "unclipped" is
the same pass without any scaling (the speculative step's cost). Bytes per parameter the pass
moves through DRAM: unclipped 28 (master, gradient, two moments read; master, moments written),
mul_ 36 (+ the gradient read and written once more, unless the chunk is still in cache), grad_scale
32 (the kernel writes the scaled gradient back in its own pass). Also prints the largest
difference of the two results (float rounding: dividing by the rounded reciprocal vs multiplying).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from tinypipe.memory.host_store import LayerState  # noqa: E402
from tinypipe.models.decompose import LayerKind, LayerSpec, ParamSlice  # noqa: E402
from tinypipe.runtime.optim.adamw import ChunkedAdamW  # noqa: E402
from tinypipe.runtime.optim.decisions import REDO_CHUNK  # noqa: E402

#: bytes per parameter through DRAM (module docstring)
BYTES = {"unclipped": 28, "mul_": 36, "grad_scale": 32}


def _state(numel: int, seed: int) -> tuple[LayerState, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    spec = LayerSpec(1, LayerKind.BLOCK, "bench", [ParamSlice("w", (numel,), 0, numel)], numel)
    st = LayerState(spec, torch.randn(numel, generator=g), torch.randn(numel, generator=g) * 1e-3,
                    torch.rand(numel, generator=g) * 1e-6, step=3)
    return st, torch.randn(numel, generator=g) * 1e-3


def deferred_pass(adamw: ChunkedAdamW, st: LayerState, grad: torch.Tensor, coef: float, variant: str) -> None:
    """One layer's deferred step, chunk by chunk, as ``variant`` applies the clip coefficient."""
    n = grad.numel()
    scale = torch.tensor(1.0 / coef, dtype=torch.float32) if variant == "grad_scale" else None
    for lo in range(0, n, REDO_CHUNK):
        hi = min(n, lo + REDO_CHUNK)
        g = grad[lo:hi]
        if variant == "mul_":
            g.mul_(coef)
        adamw.step(st, lo, hi, g, 4, 1e-4, grad_scale=scale)


def bench(numel: int, reps: int, threads: int, coef: float) -> dict:
    torch.set_num_threads(threads)
    adamw = ChunkedAdamW(1e-4, (0.9, 0.999), 1e-8, 0.01)
    st, grad = _state(numel, seed=0)
    keep = grad.clone()
    out: dict = {"threads": threads, "numel": numel}
    for variant in ("unclipped", "mul_", "grad_scale"):
        times = []
        for _ in range(reps + 1):  # the first touches the pages
            grad.copy_(keep)
            t0 = time.perf_counter()
            deferred_pass(adamw, st, grad, coef, variant)
            times.append(time.perf_counter() - t0)
        best = min(times[1:])
        out[variant] = {"best_s": best, "median_s": sorted(times[1:])[len(times[1:]) // 2],
                        "gparams_s": numel / best / 1e9, "dram_gbs": BYTES[variant] * numel / best / 1e9}
    return out


def rounding(numel: int, coef: float) -> dict:
    """The two clipped results from the same state: largest relative difference per buffer."""
    adamw = ChunkedAdamW(1e-4, (0.9, 0.999), 1e-8, 0.01)
    res = {}
    for variant in ("mul_", "grad_scale"):
        st, grad = _state(numel, seed=1)
        deferred_pass(adamw, st, grad, coef, variant)
        res[variant] = (st.master, st.exp_avg, st.exp_avg_sq, grad)
    out = {}
    for i, name in enumerate(("master", "exp_avg", "exp_avg_sq", "scaled_grad")):
        a, b = res["mul_"][i], res["grad_scale"][i]
        out[name] = {"max_abs": float((a - b).abs().max()),
                     "max_rel_to_max": float((a - b).abs().max() / a.abs().max()),
                     "share_differing": float((a != b).float().mean())}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=100_669_440, help="layer size (default: a W1 block)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", default=str(torch.get_num_threads()), help="comma-separated")
    ap.add_argument("--coef", type=float, default=0.37, help="clip coefficient")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = [bench(a.numel, a.reps, int(t), a.coef) for t in a.threads.split(",")]
    diff = rounding(min(a.numel, 1 << 24), a.coef)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, layer {a.numel / 1e6:.1f} M params, "
          f"chunks of {REDO_CHUNK} elements, best of {a.reps}")
    print("| threads | variant | s per layer | G params/s | DRAM GB/s (bytes/param) |")
    for r in rows:
        for v in ("unclipped", "mul_", "grad_scale"):
            x = r[v]
            print(f"| {r['threads']} | {v} | {x['best_s']:.3f} | {x['gparams_s']:.2f} | "
                  f"{x['dram_gbs']:.1f} ({BYTES[v]}) |")
        print(f"  grad_scale vs mul_: {r['mul_']['best_s'] / r['grad_scale']['best_s']:.3f}x faster")
    for name, d in diff.items():
        print(f"rounding {name}: max |diff| {d['max_abs']:.3g} ({d['max_rel_to_max']:.2g} of the largest), "
              f"{d['share_differing'] * 100:.2f} % of elements differ")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "cpus": os.cpu_count(), "coef": a.coef, "rows": rows,
                       "rounding": diff}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
