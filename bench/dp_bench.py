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
    python bench/dp_bench.py --mode share --workloads W3 --sharding shard --configs replicas --auto \
        --cap-gib 24 --hardware h200-pcie5 --node-memory-gib 128   # the planner's per-replica plan

Each configuration runs as its own processes (``--worker`` below; the replicas under
``python -m torch.distributed.run --nproc-per-node R``), on the same global batch (the workload's:
16 x 2048 tokens for W1/W3; each replica trains 1/R of it). Every configuration's whole output
(stdout and stderr of every process) goes to ``<out>/<workload>-<config>.log``; a failed one's
last lines are printed. Every worker writes one JSON file (rank 0: tokens/s over the timed steps;
every rank: its peak RSS and its CUDA caching allocator's peak reserved bytes per device) into
``--out``; the driver samples the workers' summed RSS while they run (the all-process peak: the
workers at the same moment, torchrun's launcher not counted -- it is in ``rss_tree_peak``).
``--json FILE`` writes every row together.

Before each configuration the driver works out the plan its processes run and their predicted
host memory (bench/dp_predict.py: ``--auto``, the planner's plan for the workload, the GPU cap and
the node's memory shared by the processes; else the hand-set ``--pack-size`` / ``--micro-batch``),
prints both, and refuses the configuration with one line when the processes' predicted need plus
``--host-reserve-gib`` exceeds what the node has available (MemAvailable, or ``--node-memory-gib``
minus what is in use on a VM whose MemTotal grows as it is used) -- a prediction, recorded in the
JSON (``prediction``, ``preflight``, ``node_memory``) beside the measured RSS. Every process runs the
driver's plan (``Engine(model, cfg, plan=...)``).
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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dp_predict import NodeMemory, Prediction, Preflight, Setting

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
    ap.add_argument("--auto", action="store_true",
                    help="the planner's plan for the workload, cap and node memory "
                         "(instead of --pack-size / --micro-batch)")
    ap.add_argument("--hardware", default=None,
                    help="hardware preset or profile JSON for the planner "
                         "(default: the GPU's, as the engine picks it)")
    ap.add_argument("--node-memory-gib", type=float, default=0.0,
                    help="the node's memory where MemTotal under-reports it (a VM growing its RAM as used); "
                         "0: MemAvailable")
    ap.add_argument("--host-reserve-gib", type=float, default=2.0,
                    help="host memory the pre-flight check keeps free (launcher, OS, prediction error)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None, help="directory for the logs and per-process JSON "
                                                "(default: a new one under /tmp)")
    ap.add_argument("--json", default=None, help="write every result to this file")
    ap.add_argument("--dry-run", action="store_true",
                    help="plan and check every configuration (the pre-flight), start none")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: WORKLOAD:TAG
    ap.add_argument("--devices", default=None, help=argparse.SUPPRESS)  # internal: the worker's devices
    ap.add_argument("--plan", default=None, help=argparse.SUPPRESS)  # internal: the driver's plan (JSON file)
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


def _worker_args(a: argparse.Namespace, workload: str, tag: str, devices: list[str], out: Path,
                 plan: Path) -> list[str]:
    """One worker's arguments (``--auto`` and ``--hardware`` reach it through the plan file)."""
    return [str(HERE / "dp_bench.py"), "--worker", f"{workload}:{tag}", "--devices", ",".join(devices),
            "--mode", a.mode, "--sharding", a.sharding, "--pack-size", str(a.pack_size),
            "--micro-batch", str(a.micro_batch), "--precision", a.precision, "--cap-gib", str(a.cap_gib),
            "--warmup", str(a.warmup), "--steps", str(a.steps), "--out", str(out), "--plan", str(plan)]


def setting(a: argparse.Namespace) -> Setting:
    import dp_predict

    return dp_predict.Setting(a.mode, a.sharding, a.auto, a.pack_size, a.micro_batch, a.precision,
                              int(a.cap_gib * 2**30), a.hardware)


def plan_row(a: argparse.Namespace, workload: str,
             row: Row) -> tuple[Prediction | None, Preflight, NodeMemory]:
    """The configuration's plan and predicted memory, and the pre-flight verdict against the node's
    memory now (no prediction: the planner found nothing that fits)."""
    import dp_predict
    from tinypipe.errors import TinypipeError
    from benchkit.workloads import WORKLOADS

    mem = dp_predict.node_memory(int(a.node_memory_gib * 2**30))
    reserve = int(a.host_reserve_gib * 2**30)
    try:
        pred = dp_predict.predict(WORKLOADS[workload], setting(a), row.procs, row.devices,
                                  mem.available - reserve)
    except TinypipeError as exc:
        return None, dp_predict.refusal(exc, mem, reserve), mem
    return pred, dp_predict.preflight(pred, mem, reserve), mem


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
    """Plan and check one configuration, then run it, its output into its log; the row's results."""
    tag = f"{workload}-{row.key}"
    pred, check, mem = plan_row(a, workload, row)
    head = {"workload": workload, "config": row.key, "label": row.label, "procs": row.procs,
            "devices": row.devices, "prediction": pred.as_dict() if pred is not None else None,
            "preflight": check.as_dict(), "node_memory": mem.as_dict()}
    print(f"== {workload}, {row.label}", flush=True)
    if pred is not None:
        print("   " + pred.text().replace("\n", "\n   "), flush=True)
    print(f"   {check.line}", flush=True)
    if not check.ok:
        return head | {"rc": None, "refused": check.line, "ranks": [], "log": None}
    if a.dry_run:
        return head | {"rc": 0, "dry_run": True, "ranks": [], "log": None}
    assert pred is not None
    plan_file = out / f"{tag}.plan.json"
    plan_file.write_text(json.dumps({"plan": pred.plan.to_json(), "text": pred.text(), "auto": a.auto,
                                     "hardware": a.hardware, "budget_node": pred.budget_node}))
    args = _worker_args(a, workload, tag, row.devices, out, plan_file)
    for old in [*out.glob(f"{tag}.rank*.json"), *out.glob(f"{tag}.progress*.json")]:
        old.unlink()  # an earlier run's, into the same --out
    if row.procs == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(row.procs),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *args]
    log = out / f"{tag}.log"
    print(f"   {' '.join(cmd)}\n   log: {log}", flush=True)
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
    progress = [json.loads(p.read_text()) for p in sorted(out.glob(f"{tag}.progress*.json"))]
    lines = log.read_text(errors="replace").splitlines()
    if rc != 0 or len(ranks) != row.procs:
        print(f"   FAILED (rc {rc}); from {log}:", flush=True)
        print("\n".join("   | " + line for line in failure_excerpt(lines)), flush=True)
    else:
        print("\n".join("   | " + line for line in lines[-3:]), flush=True)
    return head | {"rc": rc, "wall_s": time.perf_counter() - t0, "log": str(log),
                   "rss_workers_peak": rss.workers, "rss_tree_peak": rss.tree, "ranks": ranks,
                   "progress": progress}


def failure_excerpt(lines: list[str]) -> list[str]:
    """What to print of a failed configuration's log: its first traceback (the root cause: under
    torchrun the launcher's own summary comes last and hides it) and the last lines."""
    first = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), None)
    if first is None or first >= len(lines) - TAIL_LINES:
        return lines[-TAIL_LINES:]
    return lines[first : first + TAIL_LINES] + ["..."] + lines[-8:]


def drive(a: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO))  # tinypipe, for the plans (bench/ is on the path: this script's folder)
    out = Path(a.out or f"/tmp/dp_bench_{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    rows: list[dict] = []
    for workload in a.workloads.split(","):
        for row in rows_for(a):
            rows.append(run_row(a, workload, row, out, env))
            if a.json:  # after every row: a run cut short keeps the rows it finished
                Path(a.json).write_text(json.dumps(rows, indent=1))
    print(f"\nlogs and per-process JSON: {out}")
    table(rows)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def table(rows: list[dict]) -> None:
    base: dict[str, float] = {}
    print("\n| workload | configuration | tokens/s | vs 1 process | s/step | host RSS per process (GiB) "
          "| predicted per process (GiB) | host RSS, all processes (GiB) | GPU reserved per process (GiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        main = next((x for x in r["ranks"] if x["rank"] == 0), None)
        pred = r["prediction"]
        predicted = _gib(pred["per_process"]) if pred is not None else "-"
        if r.get("refused") or r.get("dry_run"):
            what = "refused before start (its pre-flight line above)" if r.get("refused") else "dry run"
            print(f"| {r['workload']} | {r['label']} | {what} | | | | {predicted} | | |")
            continue
        if r["rc"] != 0 or main is None or len(r["ranks"]) != r["procs"]:
            done = next((p["steps_s"] for p in r.get("progress", []) if p["rank"] == 0), [])
            steps = f"; {len(done)} steps done, the last {done[-1]:.1f} s" if done else ""
            print(f"| {r['workload']} | {r['label']} | failed (rc {r['rc']}, log {r['log']}{steps}) | | | | "
                  f"{predicted} | | |")
            continue
        tps = main["tokens_per_s"]
        if r["config"] == "one":
            base[r["workload"]] = tps
        ratio = f"{tps / base[r['workload']]:.2f}x" if r["workload"] in base else "-"
        ranks = sorted(r["ranks"], key=lambda x: x["rank"])
        rss = " / ".join(_gib(x["peak_rss_self"]) for x in ranks)
        gpu = " / ".join("+".join(_gib(v) for v in x["gpu_peak_reserved"].values()) or "-" for x in ranks)
        print(f"| {r['workload']} | {r['label']} | {tps:,.0f} | {ratio} | {main['seconds_per_step']:.2f} | "
              f"{rss} | {predicted} | {_gib(r['rss_workers_peak'])} | {gpu} |")


def work(a: argparse.Namespace) -> int:
    """One process of one configuration (a replica under torchrun, or the single process)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.path.insert(0, str(REPO))
    import torch

    import tinypipe
    from tinypipe.distributed.launch import init_from_environment, shutdown
    from benchkit.rss import RssSampler
    from benchkit.workloads import WORKLOADS, build_model, make_batch
    from tinypipe.schedule.plan import Plan

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
    given = json.loads(Path(a.plan).read_text())  # the driver's plan, the one its pre-flight counted
    if given["auto"]:  # the planner chose it for this workload and these budgets
        knobs = dict(seq_len=w.seq, global_batch=w.batch, hardware=given["hardware"],
                     gpu_memory_bytes=int(a.cap_gib * 2**30) if a.cap_gib > 0 else None,
                     cpu_memory_bytes=given["budget_node"])
    else:
        knobs = dict(pack_size=a.pack_size, micro_batch_size=a.micro_batch)
    with RssSampler() as rss:
        model = build_model(w)
        cfg = tinypipe.Config(devices=devices, precision=a.precision if cuda else "fp32", lr=1e-5,
                              betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, optimizer_sharding=a.sharding,
                              extra={"dp_share_devices": a.mode == "share"}, **knobs)
        engine = tinypipe.Engine(model, cfg, plan=Plan.from_json(given["plan"]))
        if rank == 0:
            print(f"plan: {engine.plan.describe()}\n{given['text'].splitlines()[-1]}", flush=True)
        batch = make_batch(w)  # the global batch: every replica trains its rows of it
        results = []
        for i in range(a.warmup + a.steps):
            r = engine.step(batch)
            results.append(r)
            if rank == 0:
                print(f"step {i + 1}: loss {r.loss:.4f}  {r.seconds:.2f} s  {r.tokens / r.seconds:,.0f} tok/s"
                      f"{'  (warm-up)' if i < a.warmup else ''}", flush=True)
            # what a run cut short (the driver's --timeout) still tells: its steps and RSS so far
            Path(a.out, f"{tag}.progress{rank}.json").write_text(json.dumps(
                {"rank": rank, "steps_s": [x.seconds for x in results], "losses": [x.loss for x in results],
                 "tokens_per_step": r.tokens, "warmup": a.warmup, "peak_rss_self": rss.peak_self}))
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
           "plan": engine.plan.describe(), "plan_json": engine.plan.to_json()}
    Path(a.out, f"{tag}.rank{rank}.json").write_text(json.dumps(out, default=str))
    gpu = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in out["gpu_peak_reserved"].items())
    print(f"rank {rank}: peak host RSS {rss.peak_self / 2**30:.2f} GiB"
          + (f"; GPU peak reserved {gpu}" if gpu else ""), flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    args = parse()
    raise SystemExit(work(args) if args.worker else drive(args))
