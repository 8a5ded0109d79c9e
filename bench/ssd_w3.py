#!/usr/bin/env python3
"""W3 (Llama-2-7B shape, full fine-tuning) with its AdamW moments -- and as much more as the host
budget needs -- on the SSD tier; tokens/s, GPU and host peaks, SSD bytes and GB/s per step, and the
step time against max(compute, SSD read, SSD write, CPU optimizer).

    python bench/ssd_w3.py --offload-dir /nvme/tmp --batch 16  --json bench/results/ssd_w3_b16.json
    python bench/ssd_w3.py --offload-dir /nvme/tmp --batch 128 --json bench/results/ssd_w3_b128.json
    python bench/ssd_w3.py --offload-dir /tmp/x --workload tiny --devices cpu --layers 2 --batch 2 \\
        --seq 64 --steps 1 --no-measure          # a dry run of the script itself (CPU, seconds)

What goes to the SSD: the plan (the planner's for the GPU budget, ``--cap-gib``, with the host
unconstrained, or the hand-set ``--pack-size``/``--micro-batch``) is sized with the planner's
accounting; then the moments of every host-stepped layer go to the SSD (``--kinds``), and while the
host need (that accounting, minus what is offloaded, plus the staging pools) exceeds
``--host-budget-gib`` (48), the master weights of blocks follow, last block first. The engine runs
with ``cpu_memory_bytes`` = the budget; the peak RSS is measured (sampled every 50 ms).

The bound: compute from the FLOP count at the measured bf16 matmul rate (and, measured, the busy
time of the compute lanes in the last step, device times), SSD read and write = the step's bytes at
the directory's rates (measured here with ``measure_rates``, 4 GiB, unless ``--ssd-read-gbps`` /
``--ssd-write-gbps`` state them), CPU optimizer = parameters at the measured fused-AdamW rate. A
single disk reading and writing at once shares its bandwidth: the serial I/O time (read + write)
is printed too.

How long (H200 machine, 1.6 / 2.4 GB/s disk): building the 7B model ~1 min, engine start ~0.5 min,
machine and disk rates ~0.5 min, a step ~35-45 s (moments: 54 GB read + 54 GB written; the first,
warm-up, step reads no moments and compiles the blocks) -- about 5-6 min with the defaults
(``--warmup 1 --steps 2``): one run per 10-minute device call. ``--steps``/``--layers`` shrink it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

import tinypipe  # noqa: E402
from tinypipe.memory.host_store import offload_regions  # noqa: E402
from tinypipe.models.decompose import Decomposition  # noqa: E402
from tinypipe.perf.analysis import lane_busy, step_bound  # noqa: E402
from tinypipe.perf.machine import measure  # noqa: E402
from tinypipe.perf.rss import RssSampler  # noqa: E402
from tinypipe.perf.workloads import WORKLOADS, Workload, build_model, make_batch  # noqa: E402
from tinypipe.schedule.plan import OFFLOAD_KINDS, Plan, make_plan  # noqa: E402
from tinypipe.schedule.staging import DEFAULT_READ_AHEAD, staging_pools  # noqa: E402

GIB = 1024**3


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--offload-dir", required=True, help="directory on the SSD for the scratch file")
    ap.add_argument("--workload", default="W3", choices=sorted(WORKLOADS))
    ap.add_argument("--batch", type=int, default=16, help="sequences per optimizer step (16 or 128)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the workload's)")
    ap.add_argument("--layers", type=int, default=None, help="decoder blocks (default: the workload's)")
    ap.add_argument("--devices", default="cuda:0")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="per-process GPU memory cap; 0 = none")
    ap.add_argument("--host-budget-gib", type=float, default=48.0, help="host memory budget (cpu_memory_bytes)")
    ap.add_argument("--kinds", default="moments", help="kinds always offloaded, e.g. moments or moments,master")
    ap.add_argument("--pack-size", type=int, default=None, help="hand-set plan (default: the planner's)")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--window", type=int, default=1)
    ap.add_argument("--stash", default="host", choices=("host", "device"))
    ap.add_argument("--max-grad-norm", type=float, default=None, help="clipping (retains gradients)")
    ap.add_argument("--read-ahead", type=int, default=None,
                    help="layers of optimizer state read ahead (default: the runtime's, 2); spare DRAM "
                         "lets the disk read during the forward too")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--ssd-read-gbps", type=float, default=None)
    ap.add_argument("--ssd-write-gbps", type=float, default=None)
    ap.add_argument("--no-measure", action="store_true", help="skip the machine and disk rate measurements")
    ap.add_argument("--compile-blocks", default="auto")
    ap.add_argument("--trace", default=None, help="Chrome trace of the last step")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def _workload(a: argparse.Namespace) -> Workload:
    w = WORKLOADS[a.workload]
    config = dict(w.config)
    if a.layers is not None:
        config["num_hidden_layers"] = a.layers
    return Workload(w.name if a.layers is None else f"{w.name}-{a.layers}L", config, a.seq or w.seq, a.batch)


def _base_plan(a: argparse.Namespace, model: torch.nn.Module, w: Workload, devices: list[str]) -> tuple[Plan, int]:
    """The plan without offload and the planner's host need for it (bytes)."""
    from tinypipe.planner.auto import CPU_HARDWARE, hardware_for
    from tinypipe.planner.search import evaluate, plan_for
    from tinypipe.planner.sizes import model_sizes

    cfg = tinypipe.Config(devices=devices, precision="bf16" if devices[0].startswith("cuda") else "fp32",
                          max_grad_norm=a.max_grad_norm)
    hw = hardware_for(cfg) if devices[0].startswith("cuda") else CPU_HARDWARE
    sizes = model_sizes(model.config)
    num_blocks = int(model.config.num_hidden_layers)
    tied = bool(model.config.tie_word_embeddings)
    if a.pack_size is None and devices[0].startswith("cuda"):
        gpu = int(a.cap_gib * GIB) if a.cap_gib > 0 else None
        result = plan_for(model.config, hw, gpus=len(devices), gpu_memory_bytes=gpu, cpu_memory_bytes=1 << 50,
                          seq=w.seq, global_batch=w.batch, precision=cfg.precision,
                          max_grad_norm=a.max_grad_norm)
        plan = dataclasses.replace(result.best.plan, offload=())
    else:
        mb = a.micro_batch or 1
        plan = make_plan(num_blocks, pack_size=a.pack_size or 1, micro_batch_size=mb, backward_micro_batch_size=mb,
                         num_devices=len(devices), prefetch_window=a.window, stash=a.stash, tied=tied)
    c = evaluate(sizes, hw, plan, seq=w.seq, global_batch=w.batch, precision=cfg.precision,
                 max_grad_norm=a.max_grad_norm)
    return plan, c.host_need


def choose_offload(a: argparse.Namespace, plan: Plan, host_need: int, dec: Decomposition,
                   dtype: torch.dtype) -> tuple[Plan, int]:
    """``plan`` with ``--kinds`` of every host-stepped layer offloaded, then block masters (last block
    first) until the host need fits the budget; returns it and its estimated host need."""
    retain = a.max_grad_norm is not None
    stepped = set().union(*(plan.device_optimized(d) for d in range(plan.num_devices)))
    host_layers = [layer for layer in range(plan.num_blocks + 2) if layer not in stepped]
    kinds = [k for k in a.kinds.split(",") if k]
    for k in kinds:
        if k not in OFFLOAD_KINDS:
            raise SystemExit(f"--kinds: {k!r} is not one of {', '.join(OFFLOAD_KINDS)}")
    offload = {(layer, k) for layer in host_layers for k in kinds}
    budget = int(a.host_budget_gib * GIB)

    def need(pairs: set[tuple[int, str]]) -> int:
        by_layer: dict[int, set[str]] = {}
        for layer, k in pairs:
            by_layer.setdefault(layer, set()).add(k)
        regions = offload_regions(dec, {k: frozenset(v) for k, v in by_layer.items()}, dtype, retain)
        sizes = {key: n * dt.itemsize for key, (n, dt) in regions.items()}
        ahead = DEFAULT_READ_AHEAD if a.read_ahead is None else a.read_ahead
        pools = staging_pools(dataclasses.replace(plan, offload=tuple(sorted(pairs))), dec.tied, sizes,
                              ahead).nbytes
        return host_need - sum(sizes.values()) + pools

    for layer in reversed([x for x in host_layers if 1 <= x <= plan.num_blocks]):
        if need(offload) <= budget:
            break
        offload |= {(layer, "master")} | ({(layer, "grad")} if retain else set())
    return dataclasses.replace(plan, offload=tuple(sorted(offload))), need(offload)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    t_start = time.perf_counter()

    def phase(name: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f} s] {name}", flush=True)

    w = _workload(a)
    devices = a.devices.split(",")
    cuda = devices[0].startswith("cuda")
    if cuda and a.cap_gib > 0:
        for dev in sorted(set(devices)):
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * GIB / total), torch.device(dev))
    rates = None if a.no_measure else measure(devices[0])
    disk = None
    if not a.no_measure and (a.ssd_read_gbps is None or a.ssd_write_gbps is None):
        from tinypipe.storage import measure_rates

        disk = measure_rates(a.offload_dir, 4 << 30)
    read_gbps = a.ssd_read_gbps or (disk["read_gbps"] if disk else None)
    write_gbps = a.ssd_write_gbps or (disk["write_gbps"] if disk else None)
    phase(f"rates measured (disk: {read_gbps} / {write_gbps} GB/s read / write)")
    results, per_step = [], []
    with RssSampler() as rss:
        rss_before = rss.sample()
        model = build_model(w)
        phase("model built")
        dtype = torch.bfloat16 if cuda else torch.float32
        base, host_need = _base_plan(a, model, w, devices)
        plan, est = choose_offload(a, base, host_need, Decomposition(model), dtype)
        print(f"plan: {plan.describe()}; host need {host_need / GIB:.1f} GiB in DRAM alone, "
              f"{est / GIB:.1f} GiB with the SSD tier (budget {a.host_budget_gib:.0f} GiB)", flush=True)
        if est > a.host_budget_gib * GIB:
            print("warning: even with every block's master on the SSD the estimate exceeds the budget; "
                  "running anyway (add --kinds moments,master to offload the embedding's and head's too)",
                  flush=True)
        cfg = tinypipe.Config(devices=devices, precision="bf16" if cuda else "fp32", lr=1e-5,
                              max_grad_norm=a.max_grad_norm, offload_dir=a.offload_dir,
                              cpu_memory_bytes=int(a.host_budget_gib * GIB), compile_blocks=a.compile_blocks,
                              trace=cuda,
                              extra={} if a.read_ahead is None else {"ssd_read_ahead": a.read_ahead})
        engine = tinypipe.Engine(model, cfg, plan=plan)
        del model
        phase("engine ready")
        batch = make_batch(w)
        for i in range(a.warmup + a.steps):
            r = engine.step(batch)
            results.append(r)
            row = {"step": i + 1, "seconds": r.seconds, "tokens_per_s": r.tokens / r.seconds, "loss": r.loss,
                   "ssd_read_bytes": r.ssd_read_bytes, "ssd_write_bytes": r.ssd_write_bytes,
                   "ssd_read_gbps": r.ssd_read_gbps, "ssd_write_gbps": r.ssd_write_gbps,
                   "gpu_peak_reserved": r.device_peak_reserved, "gpu_peak_allocated": r.device_peak_allocated,
                   "rss": rss.sample(), "warmup": i < a.warmup}
            per_step.append(row)
            print(f"step {i + 1}: {r.seconds:.2f} s  {row['tokens_per_s']:,.0f} tok/s  loss {r.loss:.4f}  "
                  f"SSD read {r.ssd_read_bytes / 1e9:.1f} GB ({r.ssd_read_gbps:.2f} GB/s)  write "
                  f"{r.ssd_write_bytes / 1e9:.1f} GB ({r.ssd_write_gbps:.2f} GB/s)  RSS {row['rss'] / GIB:.1f} GiB"
                  f"{'  (warm-up)' if i < a.warmup else ''}", flush=True)
        report = engine.memory_report()
        events = engine.step_timeline()
        if a.trace:
            engine.export_trace(a.trace)
        dec = engine.decomposition
        params = engine.store.param_count
        engine.close()
    timed = results[a.warmup:] or results
    sec = sum(r.seconds for r in timed) / len(timed)
    read_b = sum(r.ssd_read_bytes for r in timed) / len(timed)
    write_b = sum(r.ssd_write_bytes for r in timed) / len(timed)
    busy = {lane: sum(b - x for x, b in iv) / 1e6 for lane, iv in lane_busy(events).items()}
    compute_busy = sum(v for k, v in busy.items() if k.endswith(":compute"))
    bound = {
        "ssd_read_s": read_b / (read_gbps * 1e9) if read_gbps else None,
        "ssd_write_s": write_b / (write_gbps * 1e9) if write_gbps else None,
        "compute_busy_s": compute_busy,
        "optimizer_busy_s": busy.get("host:optimizer", 0.0),
    }
    if rates is not None:
        b = step_bound(params, sum(x.param_count for x in dec.blocks), dec.head.param_count, dec.num_blocks,
                       int(w.config["hidden_size"]), w.seq, w.batch, rates)
        bound["compute_s"] = b.compute_s if b.compute_s == b.compute_s else compute_busy
        bound["cpu_optimizer_s"] = b.optimizer_s
    terms = [bound.get("compute_s", compute_busy), bound["ssd_read_s"], bound["ssd_write_s"],
             bound.get("cpu_optimizer_s")]
    bound_s = max((t for t in terms if t is not None), default=None)
    out = {
        "workload": w.name, "seq": w.seq, "batch": w.batch, "devices": devices, "args": vars(a),
        "plan": plan.as_dict(), "plan_text": plan.describe(), "host_need_dram_only": host_need,
        "host_need_estimate": est, "tokens_per_s": w.tokens / sec, "seconds_per_step": sec,
        "steps": per_step, "peak_rss": rss.peak, "peak_rss_self": rss.peak_self, "rss_before": rss_before,
        "gpu_peak_reserved": max(r.device_peak_reserved for r in results),
        "gpu_peak_allocated": max(r.device_peak_allocated for r in results),
        "ssd_read_bytes_per_step": read_b, "ssd_write_bytes_per_step": write_b,
        "disk_rates": disk, "ssd_read_gbps_used": read_gbps, "ssd_write_gbps_used": write_gbps,
        "rates": rates.as_dict() if rates is not None else None, "lane_busy_s": busy, "bound": bound,
        "bound_s": bound_s, "serial_io_s": (bound["ssd_read_s"] or 0) + (bound["ssd_write_s"] or 0),
        "memory_report": report.as_dict(), "torch": torch.__version__,
    }
    print(report.to_text())
    print(f"\n=== SSD tier, {w.name}, {w.batch} x {w.seq} tokens per step ===")
    print(f"plan: {plan.describe()}")
    print(f"tokens/s {w.tokens / sec:,.0f}   {sec:.2f} s/step   peak RSS {rss.peak / GIB:.2f} GiB   GPU peak "
          f"reserved {out['gpu_peak_reserved'] / GIB:.2f} GiB, allocated {out['gpu_peak_allocated'] / GIB:.2f} GiB")
    print(f"SSD per step: read {read_b / 1e9:.1f} GB, write {write_b / 1e9:.1f} GB")
    for name, value in (("compute (FLOPs at the measured rate)", bound.get("compute_s")),
                        ("compute lanes busy (last step)", compute_busy),
                        ("SSD read", bound["ssd_read_s"]), ("SSD write", bound["ssd_write_s"]),
                        ("CPU optimizer (measured AdamW rate)", bound.get("cpu_optimizer_s")),
                        ("optimizer lane busy (last step)", bound["optimizer_busy_s"])):
        if value is not None:
            print(f"  {name:<40} {value:8.2f} s")
    if bound_s:
        print(f"  bound max(compute, read, write, optimizer) {bound_s:.2f} s -> measured/bound "
              f"{sec / bound_s:.2f}; serial I/O (read + write) {out['serial_io_s']:.2f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    phase("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
