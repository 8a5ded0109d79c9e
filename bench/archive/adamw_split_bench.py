#!/usr/bin/env python3
"""Host AdamW in one pass vs split in two (weights first, moments later), per thread count (#16).

A clipped step's host AdamW gates the next forward. The forward needs only the new weights, and
the moments do not depend on the weights, so the pass can be split (runtime/optim/adamw.py):
the **weights pass** reads master, moments and gradient but writes only the master (the moments it
computes go to a small scratch buffer that stays in cache), and the **moments pass** writes the
moments later, while the next backward runs. A memory-bound pass moves 28 B/param in one pass,
20 B/param in the weights pass. This times the three with torch's fused CPU AdamW and checks that
the split gives the same bits as one pass.

    python bench/archive/adamw_split_bench.py --params 400 --threads 16,8 --json out.json
    python bench/archive/adamw_split_bench.py --params 400 --chunks 262144,1048576 --beside-link --json out.json

Prints a table last: G params/s of the one pass, the weights pass and the moments pass.

``--beside-link`` (CUDA) times each pass again while a thread keeps the link busy both ways
(page-locked host buffers to the device and back, as a clipped step's uploads and assisted
round trips do): in the forward after a clipped step the host pass and the link share host DRAM
(bench/results/s9_assist_roundtrip_s9.json: the fused pass fell from 4.37 to ~3 G params/s beside
round trips), and a weights pass reads and writes 8 B/param less of it than one pass.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from typing import Iterator

import torch
import torch.optim.adamw as _adamw


def _adamw_call(p, g, m, v, step: int, scale: torch.Tensor | None) -> None:
    _adamw.adamw([p], [g], [m], [v], [], [torch.tensor(float(step - 1))], fused=True, grad_scale=scale,
                 amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.01, eps=1e-8,
                 maximize=False)


def one_pass(p, g, m, v, chunk: int, step: int, scale) -> None:
    for a in range(0, p.numel(), chunk):
        b = min(p.numel(), a + chunk)
        _adamw_call(p[a:b], g[a:b], m[a:b], v[a:b], step, scale)


def weights_pass(p, g, m, v, chunk: int, step: int, scale, ms, vs) -> None:
    for a in range(0, p.numel(), chunk):
        b = min(p.numel(), a + chunk)
        n = b - a
        ms[:n].copy_(m[a:b])
        vs[:n].copy_(v[a:b])
        _adamw_call(p[a:b], g[a:b], ms[:n], vs[:n], step, scale)


def moments_pass(g, m, v, chunk: int, step: int, ps) -> None:
    for a in range(0, g.numel(), chunk):
        b = min(g.numel(), a + chunk)
        _adamw_call(ps[: b - a], g[a:b], m[a:b], v[a:b], step, None)


@contextlib.contextmanager
def link_traffic(enabled: bool, nbytes: int = 1 << 30) -> Iterator[dict]:
    """While inside, a thread copies ``nbytes`` up and down at once, again and again (CUDA only);
    yields a dict that holds the GB/s both ways together once the block ends."""
    out: dict = {}
    if not enabled:
        yield out
        return
    import torch.cuda as cuda

    up_src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    down_dst = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s_up, s_down = cuda.Stream(), cuda.Stream()
    done = threading.Event()
    moved = [0]

    def loop() -> None:
        while not done.is_set():
            with cuda.stream(s_up):
                dev_a.copy_(up_src, non_blocking=True)
            with cuda.stream(s_down):
                down_dst.copy_(dev_b, non_blocking=True)
            s_up.synchronize()
            s_down.synchronize()
            moved[0] += 2 * nbytes

    worker = threading.Thread(target=loop)
    t0 = time.perf_counter()
    worker.start()
    try:
        yield out
    finally:
        done.set()
        worker.join()
        out["link_gbs"] = moved[0] / (time.perf_counter() - t0) / 1e9


def run(n: int, chunk: int, threads: int, repeat: int, beside_link: bool = False) -> dict:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    g0 = torch.randn(n, generator=gen) * 1e-2
    m0 = torch.randn(n, generator=gen) * 1e-3
    v0 = torch.rand(n, generator=gen) * 1e-5
    scale = torch.tensor(2.5)
    p, g, m, v = p0.clone(), g0.clone(), m0.clone(), v0.clone()
    ms, vs, ps = torch.empty(chunk), torch.empty(chunk), torch.empty(chunk)
    # the split must give the bits of one pass
    one_pass(p, g, m, v, chunk, 3, scale)
    p2, g2, m2, v2 = p0.clone(), g0.clone(), m0.clone(), v0.clone()
    weights_pass(p2, g2, m2, v2, chunk, 3, scale, ms, vs)
    moments_pass(g2, m2, v2, chunk, 3, ps)
    same = bool(torch.equal(p, p2) and torch.equal(m, m2) and torch.equal(v, v2) and torch.equal(g, g2))
    times = {"one_pass": [], "weights_pass": [], "moments_pass": []}
    with link_traffic(beside_link) as link:
        for _ in range(repeat):
            t0 = time.perf_counter()
            one_pass(p, g, m, v, chunk, 3, None)
            times["one_pass"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            weights_pass(p, g, m, v, chunk, 3, None, ms, vs)
            times["weights_pass"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            moments_pass(g, m, v, chunk, 3, ps)
            times["moments_pass"].append(time.perf_counter() - t0)
    best = {k: min(t) for k, t in times.items()}
    return {"params": n, "chunk": chunk, "threads": threads, "bit_identical": same, "beside_link": beside_link,
            "link_gbs": link.get("link_gbs"), "seconds": best,
            "gparams_per_s": {k: n / s / 1e9 for k, s in best.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=100, help="millions of parameters")
    ap.add_argument("--threads", default=str(torch.get_num_threads()), help="comma list")
    ap.add_argument("--chunks", default="1048576,4194304", help="comma list of elements per call")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--beside-link", action="store_true", help="also time each beside link traffic (CUDA)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    n = int(a.params * 1e6)
    modes = (False, True) if a.beside_link else (False,)
    rows = [run(n, int(c), int(t), a.repeat, link) for t in a.threads.split(",") for c in a.chunks.split(",")
            for link in modes]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{'threads':>7} {'chunk':>9} {'link GB/s':>9} {'one pass':>9} {'weights':>9} {'moments':>9}"
          "  G params/s; bits equal")
    for r in rows:
        gp = r["gparams_per_s"]
        link = f"{r['link_gbs']:9.1f}" if r["link_gbs"] is not None else f"{'-':>9}"
        print(f"{r['threads']:>7} {r['chunk']:>9} {link} {gp['one_pass']:>9.2f} {gp['weights_pass']:>9.2f} "
              f"{gp['moments_pass']:>9.2f}  {r['bit_identical']}")


if __name__ == "__main__":
    main()
