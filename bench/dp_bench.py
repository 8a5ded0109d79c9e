#!/usr/bin/env python3
"""Data-parallel replicas vs one device vs one pipeline over the same devices (issue #15): tokens/s,
host RSS per process and of all processes together, GPU memory reserved per process; table last.

    python bench/dp_bench.py                      # W1: 1 GPU, 2 replicas x 1 GPU (torchrun, NCCL),
                                                  # 1 pipeline x 2 GPUs
    python bench/dp_bench.py --workloads W1,W3 --sharding shard
    python bench/dp_bench.py --mode share         # one GPU: 1 GPU, two ranks sharing it (gloo over CUDA
                                                  # tensors; NCCL refuses two ranks on one GPU), one
                                                  # pipeline over it twice -- overlap, not speed
    python bench/dp_bench.py --mode cpu --workloads tiny --steps 2   # smoke test, gloo on the CPU

Each configuration runs as its own processes (``--worker`` below; the replicas under
``python -m torch.distributed.run --nproc-per-node R``), on the same global batch (the workload's:
16 x 2048 tokens for W1/W3; each replica trains 1/R of it). Every configuration's whole output
(stdout and stderr of every process) goes to ``<out>/<workload>-<config>.log``; a failed one's
last lines are printed. Every worker writes one JSON file (rank 0: tokens/s over the timed steps;
every rank: its peak RSS and its CUDA caching allocator's peak reserved bytes per device) into
``--out``; the driver samples the workers' summed RSS while they run (the all-process peak: the
workers at the same moment, torchrun's launcher not counted -- it is in ``rss_tree_peak``).
``--json FILE`` writes every row together.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TAIL_LINES = 40  # lines of a failed configuration's log printed (its first traceback, its end)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="W1", help="comma list of perf workloads (W1, W3, tiny)")
    ap.add_argument("--mode", default="gpu", choices=("gpu", "share", "cpu"))
    ap.add_argument("--replicas", type=int, default=2, help="replicas, and devices of the pipeline row")
    ap.add_argument("--configs", default="one,replicas,pipeline",
                    help="comma list of the rows to run: one (1 device), replicas, pipeline")
    ap.add_argument("--sharding", default="replicate", choices=("replicate", "shard"))
    ap.add_argument("--pack-size", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--cap-gib", type=float, default=0.0, help="per-process GPU memory cap (0: none)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None, help="directory for the logs and per-process JSON "
                                                "(default: a new one under /tmp)")
    ap.add_argument("--json", default=None, help="write every result to this file")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: WORKLOAD:TAG
    ap.add_argument("--devices", default=None, help=argparse.SUPPRESS)  # internal: the worker's devices
    return ap.parse_args(argv)


@dataclass(frozen=True)
class Row:
    """One configuration: ``procs`` processes (torchrun when > 1), each driving ``devices``."""

    key: str
    label: str
    procs: int
    devices: list[str]


def rows_for(a: argparse.Namespace) -> list[Row]:
    """The configurations of ``--mode``, all on the same global batch."""
    R = a.replicas
    if a.mode == "cpu":
        one, pipe = ["cpu"], ["cpu"] * R
    elif a.mode == "share":
        one, pipe = ["cuda:0"], ["cuda:0"] * R  # one GPU, entered R times
    else:
        one, pipe = ["cuda:0"], [f"cuda:{i}" for i in range(R)]
    unit = "device" if a.mode != "gpu" else "GPU"
    every = {
        "one": Row("one", f"1 process, 1 {unit}", 1, one),
        # each replica's cuda:0: its own GPU under torchrun (the topology maps it), or the shared one
        "replicas": Row("replicas", f"{R} replicas x 1 {unit} ({a.mode})", R, one),
        "pipeline": Row("pipeline", f"1 pipeline x {R} {unit}s ({a.mode})", 1, pipe),
    }
    return [every[k] for k in a.configs.split(",")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_args(a: argparse.Namespace, workload: str, tag: str, devices: list[str], out: Path) -> list[str]:
    return [str(HERE / "dp_bench.py"), "--worker", f"{workload}:{tag}", "--devices", ",".join(devices),
            "--mode", a.mode, "--sharding", a.sharding, "--pack-size", str(a.pack_size),
            "--micro-batch", str(a.micro_batch), "--precision", a.precision, "--cap-gib", str(a.cap_gib),
            "--warmup", str(a.warmup), "--steps", str(a.steps), "--out", str(out)]


class TreeRss:
    """Samples, while a configuration runs, the summed RSS of the driver's descendants: the workers
    (``--worker`` in the command line, not torchrun's launcher -- it passes the same arguments on)
    and the whole tree (the launcher too)."""

    def __init__(self, interval: float = 0.1) -> None:
        import psutil

        self.interval, self._proc = interval, psutil.Process()
        self.workers = self.tree = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dp-bench-rss", daemon=True)

    def _sample(self) -> None:
        import psutil

        workers = tree = 0
        for p in self._proc.children(recursive=True):
            try:
                rss = p.memory_info().rss
                tree += rss
                line = p.cmdline()
                if "--worker" in line and "torch.distributed.run" not in line:
                    workers += rss
            except psutil.Error:
                pass
        self.workers, self.tree = max(self.workers, workers), max(self.tree, tree)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> TreeRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_row(a: argparse.Namespace, workload: str, row: Row, out: Path, env: dict[str, str]) -> dict:
    """Run one configuration, its output into its log; the row's results."""
    tag = f"{workload}-{row.key}"
    args = _worker_args(a, workload, tag, row.devices, out)
    if row.procs == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(row.procs),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *args]
    log = out / f"{tag}.log"
    print(f"== {workload}, {row.label}: {' '.join(cmd)}\n   log: {log}", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f, TreeRss() as rss:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: a timeout ends all of it
        try:
            rc = proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
            f.write(f"\n[dp_bench] killed after {a.timeout:.0f} s\n")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob(f"{tag}.rank*.json"))]
    lines = log.read_text(errors="replace").splitlines()
    if rc != 0 or len(ranks) != row.procs:
        print(f"   FAILED (rc {rc}); from {log}:", flush=True)
        print("\n".join("   | " + line for line in failure_excerpt(lines)), flush=True)
    else:
        print("\n".join("   | " + line for line in lines[-3:]), flush=True)
    return {"workload": workload, "config": row.key, "label": row.label, "procs": row.procs,
            "devices": row.devices, "rc": rc, "wall_s": time.perf_counter() - t0, "log": str(log),
            "rss_workers_peak": rss.workers, "rss_tree_peak": rss.tree, "ranks": ranks}


def failure_excerpt(lines: list[str]) -> list[str]:
    """What to print of a failed configuration's log: its first traceback (the root cause: under
    torchrun the launcher's own summary comes last and hides it) and the last lines."""
    first = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), None)
    if first is None or first >= len(lines) - TAIL_LINES:
        return lines[-TAIL_LINES:]
    return lines[first : first + TAIL_LINES] + ["..."] + lines[-8:]


def drive(a: argparse.Namespace) -> int:
    out = Path(a.out or f"/tmp/dp_bench_{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    rows = [run_row(a, workload, row, out, env) for workload in a.workloads.split(",") for row in rows_for(a)]
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(f"\nlogs and per-process JSON: {out}")
    table(rows)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def table(rows: list[dict]) -> None:
    base: dict[str, float] = {}
    print("\n| workload | configuration | tokens/s | vs 1 process | s/step | host RSS per process (GiB) "
          "| host RSS, all processes (GiB) | GPU reserved per process (GiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        main = next((x for x in r["ranks"] if x["rank"] == 0), None)
        if r["rc"] != 0 or main is None or len(r["ranks"]) != r["procs"]:
            print(f"| {r['workload']} | {r['label']} | failed (rc {r['rc']}, log {r['log']}) | | | | | |")
            continue
        tps = main["tokens_per_s"]
        if r["config"] == "one":
            base[r["workload"]] = tps
        ratio = f"{tps / base[r['workload']]:.2f}x" if r["workload"] in base else "-"
        ranks = sorted(r["ranks"], key=lambda x: x["rank"])
        rss = " / ".join(_gib(x["peak_rss_self"]) for x in ranks)
        gpu = " / ".join("+".join(_gib(v) for v in x["gpu_peak_reserved"].values()) or "-" for x in ranks)
        print(f"| {r['workload']} | {r['label']} | {tps:,.0f} | {ratio} | {main['seconds_per_step']:.2f} | "
              f"{rss} | {_gib(r['rss_workers_peak'])} | {gpu} |")


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
    devices = a.devices.split(",")
    cuda = any(d.startswith("cuda") for d in devices)
    if cuda:
        torch.cuda.set_device(0 if a.mode == "share" or not ranked else local)
        if a.cap_gib > 0:
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, a.cap_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory))
    with RssSampler() as rss:
        model = build_model(w)
        cfg = tinypipe.Config(devices=devices, precision=a.precision if cuda else "fp32", lr=1e-5,
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
        used = sorted({d.backend.device for d in engine.devices if d.backend.is_cuda}, key=str)
        report = engine.memory_report()
        engine.close()
    timed = results[a.warmup:]
    sec = sum(r.seconds for r in timed) / len(timed)
    out = {"rank": rank, "workload": workload, "devices": devices, "tokens_per_s": timed[0].tokens / sec,
           "seconds_per_step": sec, "losses": [r.loss for r in results], "peak_rss_self": rss.peak_self,
           "peak_rss": rss.peak, "host_bytes": report.host if hasattr(report, "host") else None,
           # the caching allocator's peak (NCCL's and the CUDA context's own memory are not in it)
           "gpu_peak_reserved": {str(d): torch.cuda.max_memory_reserved(d) for d in used},
           "plan": engine.plan.describe()}
    Path(a.out, f"{tag}.rank{rank}.json").write_text(json.dumps(out, default=str))
    gpu = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in out["gpu_peak_reserved"].items())
    print(f"rank {rank}: peak host RSS {rss.peak_self / 2**30:.2f} GiB"
          + (f"; GPU peak reserved {gpu}" if gpu else ""), flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    args = parse()
    raise SystemExit(work(args) if args.worker else drive(args))
