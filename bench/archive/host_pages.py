#!/usr/bin/env python3
"""Host AdamW rate by OpenMP threads and by how the state's pages were allocated (#16).

W1's tail is the host AdamW lane running behind the backward (bench/RESULTS.md, session 12), and
the same plan's step time drifted from run to run within one device call (session 13: the
startup AdamW probe fell 4.34 -> 3.93 -> 3.53 -> 2.47 G params/s over four runs in a row). Two
suspects are cheap to separate here:

* the thread count: the engine gives the lane ``cores - 1 - GPUs`` threads (runtime/build.py);
* the pages: torch's allocator returns ordinary anonymous memory, which the kernel backs with
  2 MiB pages only where its transparent-hugepage mode and free-memory fragmentation allow;
  ``madvise(MADV_HUGEPAGE)`` asks for them explicitly.

It steps ``--layers`` layers of ``--layer-params`` fp32 parameters (master, gradient, two
moments: 16 B/param, far beyond the caches) one layer per fused call, as the host lane does, and
reports G params/s (median of ``--passes``) per (allocation, threads), the kernel's THP settings
and how much of the state ended up on huge pages. Prints a table last; ``--json`` writes it.

    python bench/archive/host_pages.py --threads 12,14,16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import time
from pathlib import Path

import torch
import torch.optim.adamw as _adamw


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


def _anon_huge_kib() -> int:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


def _alloc(numel: int, huge: bool, keep: list) -> torch.Tensor:
    """``numel`` fp32 host elements: torch's allocator, or an anonymous mapping advised huge."""
    if not huge:
        return torch.empty(numel, dtype=torch.float32)
    buf = mmap.mmap(-1, numel * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    keep.append(buf)
    return torch.frombuffer(buf, dtype=torch.float32)


def _rate(layers: list[tuple[torch.Tensor, ...]], passes: int) -> float:
    n = sum(p.numel() for p, *_ in layers)
    times = []
    for i in range(passes):
        t = time.perf_counter()
        for p, g, m, v in layers:
            _adamw.adamw([p], [g], [m], [v], [], [torch.tensor(float(i))], fused=True, amsgrad=False,
                         beta1=0.9, beta2=0.999, lr=1e-5, weight_decay=0.0, eps=1e-8, maximize=False)
        times.append(time.perf_counter() - t)
    return n / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layer-params", type=int, default=100_000_000)
    ap.add_argument("--threads", default="12,14,16")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    threads = [int(x) for x in a.threads.split(",")]
    out = {"thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
           "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
           "cores": torch.get_num_threads(), "layers": a.layers, "layer_params": a.layer_params, "rows": []}
    print(f"THP enabled: {out['thp_enabled']}  defrag: {out['thp_defrag']}  torch threads: {out['cores']}")
    for huge in (False, True):
        keep: list = []
        before = _anon_huge_kib()
        layers = []
        for _ in range(a.layers):
            p, g, m, v = (_alloc(a.layer_params, huge, keep) for _ in range(4))
            for t in (p, g, m):
                t.normal_()
            v.uniform_()
            layers.append((p, g, m, v))
        huge_gib = (_anon_huge_kib() - before) / 2**20
        state_gib = a.layers * a.layer_params * 16 / 2**30
        for n in threads:
            torch.set_num_threads(n)
            r = _rate(layers, a.passes)
            row = {"alloc": "madvise huge" if huge else "torch", "threads": n, "gparams_s": r,
                   "huge_gib": huge_gib, "state_gib": state_gib}
            out["rows"].append(row)
            print(f"{row['alloc']:13s} threads {n:2d}: {r:.2f} G params/s  ({huge_gib:.1f} of {state_gib:.1f} GiB "
                  "on huge pages)", flush=True)
        del layers, keep
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    print("\n| allocation | threads | G params/s | state on huge pages |\n|---|---|---|---|")
    for row in out["rows"]:
        print(f"| {row['alloc']} | {row['threads']} | {row['gparams_s']:.2f} | "
              f"{row['huge_gib']:.1f} of {row['state_gib']:.1f} GiB |")


if __name__ == "__main__":
    main()
