#!/usr/bin/env python3
"""Data-parallel replicas vs one GPU (issue #15): tokens/s and per-process host RSS, table last.

    python bench/dp_bench.py                      # W1: 2 replicas x 1 GPU (torchrun, NCCL) vs 1 GPU
    python bench/dp_bench.py --workloads W1,W3 --sharding shard
    python bench/dp_bench.py --mode share         # one GPU: two ranks share it (gloo over CUDA tensors;
                                                  # NCCL refuses two ranks on one GPU) -- overlap, not speed
    python bench/dp_bench.py --mode cpu --workloads tiny --steps 2   # smoke test, gloo on the CPU

Each configuration runs as its own processes (``--worker`` below; the replicas under
``python -m torch.distributed.run --nproc-per-node 2``), on the same global batch (the workload's:
16 x 2048 tokens for W1/W3, each replica training half of it). Every process writes one JSON file
(rank 0: tokens/s over the timed steps; every rank: its peak RSS) into ``--out``; ``--json FILE``
writes them all together.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="W1", help="comma list of perf workloads (W1, W3, tiny)")
    ap.add_argument("--mode", default="gpu", choices=("gpu", "share", "cpu"))
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--sharding", default="replicate", choices=("replicate", "shard"))
    ap.add_argument("--pack-size", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--cap-gib", type=float, default=0.0, help="per-process GPU memory cap (0: none)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None, help="directory for the per-process JSON (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write every result to this file")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: WORKLOAD:LABEL
    return ap.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_args(a: argparse.Namespace, workload: str, label: str, out: Path) -> list[str]:
    return [str(HERE / "dp_bench.py"), "--worker", f"{workload}:{label}", "--mode", a.mode,
            "--replicas", str(a.replicas), "--sharding", a.sharding, "--pack-size", str(a.pack_size),
            "--micro-batch", str(a.micro_batch), "--precision", a.precision, "--cap-gib", str(a.cap_gib),
            "--warmup", str(a.warmup), "--steps", str(a.steps), "--out", str(out)]


def drive(a: argparse.Namespace) -> int:
    out = Path(a.out or f"/tmp/dp_bench_{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    rows = []
    for workload in a.workloads.split(","):
        for label, procs in (("1 process", 1), (f"{a.replicas} replicas ({a.mode})", a.replicas)):
            tag = f"{workload}-{procs}"
            args = _worker_args(a, workload, tag, out)
            if procs == 1:
                cmd = [sys.executable, *args]
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs),
                       "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *args]
            print(f"== {workload}, {label}: {' '.join(cmd)}", flush=True)
            t0 = time.perf_counter()
            rc = subprocess.run(cmd, env=env, cwd=str(REPO), timeout=a.timeout).returncode
            ranks = [json.loads(p.read_text()) for p in sorted(out.glob(f"{tag}.rank*.json"))]
            rows.append({"workload": workload, "label": label, "procs": procs, "rc": rc,
                         "wall_s": time.perf_counter() - t0, "ranks": ranks})
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    _table(rows)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


def _table(rows: list[dict]) -> None:
    base: dict[str, float] = {}
    print("\n| workload | configuration | tokens/s | vs 1 process | s/step | host RSS per process (GiB) "
          "| host RSS, all processes (GiB) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        main = next((x for x in r["ranks"] if x["rank"] == 0), None)
        if r["rc"] != 0 or main is None:
            print(f"| {r['workload']} | {r['label']} | failed (rc {r['rc']}) | | | | |")
            continue
        tps = main["tokens_per_s"]
        if r["procs"] == 1:
            base[r["workload"]] = tps
        ratio = tps / base[r["workload"]] if r["workload"] in base else float("nan")
        rss = [x["peak_rss_self"] / 2**30 for x in sorted(r["ranks"], key=lambda x: x["rank"])]
        print(f"| {r['workload']} | {r['label']} | {tps:,.0f} | {ratio:.2f}x | "
              f"{main['seconds_per_step']:.2f} | {' / '.join(f'{g:.1f}' for g in rss)} | {sum(rss):.1f} |")


def work(a: argparse.Namespace) -> int:
    """One process of one configuration (a replica under torchrun, or the single process)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.path.insert(0, str(REPO))
    import torch

    import tinypipe
    from tinypipe.distributed.launch import init_from_environment, shutdown
    from tinypipe.perf.rss import RssSampler
    from tinypipe.perf.workloads import WORKLOADS, build_model, make_batch

    workload, tag = a.worker.split(":")
    w = WORKLOADS[workload]
    ranked = init_from_environment()
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = a.mode != "cpu"
    device = "cpu" if not cuda else "cuda:0"  # each replica's cuda:0 is its own GPU (topology maps it)
    if cuda:
        torch.cuda.set_device(0 if a.mode == "share" or not ranked else local)
        if a.cap_gib > 0:
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, a.cap_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory))
    with RssSampler() as rss:
        model = build_model(w)
        cfg = tinypipe.Config(devices=[device], precision=a.precision if cuda else "fp32", lr=1e-5,
                              betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, pack_size=a.pack_size,
                              micro_batch_size=a.micro_batch, optimizer_sharding=a.sharding,
                              extra={"dp_share_devices": a.mode == "share"})
        engine = tinypipe.Engine(model, cfg)
        if rank == 0:
            print(f"plan: {engine.plan.describe()}", flush=True)
        batch = make_batch(w)  # the global batch: every replica trains its rows of it
        results = []
        for i in range(a.warmup + a.steps):
            r = engine.step(batch)
            results.append(r)
            if rank == 0:
                print(f"step {i + 1}: loss {r.loss:.4f}  {r.seconds:.2f} s  {r.tokens / r.seconds:,.0f} tok/s"
                      f"{'  (warm-up)' if i < a.warmup else ''}", flush=True)
        report = engine.memory_report()
        engine.close()
    timed = results[a.warmup:]
    sec = sum(r.seconds for r in timed) / len(timed)
    out = {"rank": rank, "workload": workload, "tokens_per_s": timed[0].tokens / sec, "seconds_per_step": sec,
           "losses": [r.loss for r in results], "peak_rss_self": rss.peak_self, "peak_rss": rss.peak,
           "host_bytes": report.host if hasattr(report, "host") else None, "plan": engine.plan.describe()}
    Path(a.out, f"{tag}.rank{rank}.json").write_text(json.dumps(out, default=str))
    shutdown()
    return 0


if __name__ == "__main__":
    args = parse()
    raise SystemExit(work(args) if args.worker else drive(args))
