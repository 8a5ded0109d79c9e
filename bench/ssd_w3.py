#!/usr/bin/env python3
"""W3 (Llama-2-7B shape, full fine-tuning) with as much of its training state on the SSD tier as
the host budget needs; tokens/s, GPU and host peaks, SSD bytes and GB/s per step, the step time
against max(compute, SSD read, SSD write, CPU optimizer), and the planner's prediction -- for one
or several global batches in one call (one engine after the other, one JSON record per batch).

    python bench/ssd_w3.py --offload-dir /nvme/tmp --batches 16,128 --json-dir bench/results
        # -> bench/results/s5_ssd_w3_b16.json, ..._b128.json, and a measured-vs-predicted table
    python bench/ssd_w3.py --offload-dir /tmp/x --workload tiny --devices cpu --layers 2 --batch 2 \\
        --seq 64 --steps 1 --no-measure          # a dry run of the script itself (CPU, seconds)

What goes where: the planner's plan for the GPU cap (``--cap-gib``), the host budget
(``--host-budget-gib``, 48: ``cpu_memory_bytes``) and the disk (its free space, at most
``--scratch-gib``), with the SSD as the overflow -- the planner weighs packs, stash places (a host
stash grows with the batch: 62 GiB at 128 x 2048 with every pack input on the host) and offload
sets together. Session 4 planned the GPU with the host unconstrained and then filled the SSD:
at 128 sequences that chose a host stash of 62 GiB and needed 74.3 GiB of scratch (moments and
every block's master); the planner's own plan there needs 50.2 GiB (moments only, pack 6, three
pack inputs stashed on the host, four on the device). A hand-set plan (``--pack-size`` ...) gets
the planner's offload set for the budget. The engine runs with ``cpu_memory_bytes`` = the budget;
the peak RSS is measured (sampled every 50 ms, per run).

The bound: compute from the FLOP count at the measured bf16 matmul rate (and, measured, the busy
time of the compute lanes in the last step, device times), SSD read and write = the step's bytes at
the directory's rates (measured here with ``measure_rates``, 4 GiB, unless ``--ssd-read-gbps`` /
``--ssd-write-gbps`` state them), CPU optimizer = parameters at the measured fused-AdamW rate. A
single disk reading and writing at once shares its bandwidth: the serial I/O time (read + write)
is printed too. The prediction is the planner's for the plan that ran (``h200-pcie5`` preset, the
SSD rates used here).

How long (H200 machine, 1.6 / 2.4 GB/s disk): machine and disk rates ~0.5 min once; per batch:
building the 7B model ~1 min, engine start ~0.5 min, then ``--warmup`` + ``--steps`` steps (the
first, warm-up, step reads no moments and compiles the blocks; ~45 s at 16 sequences, ~60 s at
128). ``--time-limit`` (570 s) skips a batch whose estimated run (setup + steps at the planner's
step time x 1.3) would end past it, so one call stays inside a 10-minute device call: with the
defaults (``--warmup 1 --steps 1``) 16 and 128 fit one call.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

import tinypipe  # noqa: E402
from benchkit.analysis import is_compute_lane, lane_busy, step_bound  # noqa: E402
from benchkit.rss import RssSampler  # noqa: E402
from benchkit.workloads import WORKLOADS, Workload, build_model, make_batch  # noqa: E402
from tinypipe.devices.rates import measure  # noqa: E402
from tinypipe.planner.candidate import Candidate  # noqa: E402
from tinypipe.planner.offload import disk_bytes  # noqa: E402
from tinypipe.planner.ssd import SsdSpec, free_space  # noqa: E402
from tinypipe.schedule.ids import OPTIMIZER_LANE  # noqa: E402
from tinypipe.schedule.plan import Plan, make_plan  # noqa: E402

GIB = 1024**3


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--offload-dir", required=True, help="directory on the SSD for the scratch file")
    ap.add_argument("--workload", default="W3", choices=sorted(WORKLOADS))
    ap.add_argument("--batch", type=int, default=None, help="sequences per optimizer step (one run)")
    ap.add_argument("--batches", default=None,
                    help="comma-separated global batches, one run each, e.g. 16,128")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the workload's)")
    ap.add_argument("--layers", type=int, default=None, help="decoder blocks (default: the workload's)")
    ap.add_argument("--devices", default="cuda:0")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="per-process GPU memory cap; 0 = none")
    ap.add_argument("--host-budget-gib", type=float, default=48.0,
                    help="host memory budget (cpu_memory_bytes)")
    ap.add_argument("--scratch-gib", type=float, default=60.0,
                    help="most scratch the plan may put on the disk (besides the disk's free space)")
    ap.add_argument("--pack-size", type=int, default=None, help="hand-set plan (default: the planner's)")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--window", type=int, default=1)
    ap.add_argument("--stash", default="host", choices=("host", "device"))
    ap.add_argument("--max-grad-norm", type=float, default=None, help="clipping (retains gradients)")
    ap.add_argument("--read-ahead", type=int, default=None,
                    help="layers of optimizer state read ahead (default: the runtime's, 2); spare DRAM "
                         "lets the disk read during the forward too")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=570.0,
                    help="seconds: skip a batch whose estimated run would end past this (0: no limit)")
    ap.add_argument("--ssd-read-gbps", type=float, default=None)
    ap.add_argument("--ssd-write-gbps", type=float, default=None)
    ap.add_argument("--no-measure", action="store_true", help="skip the machine and disk rate measurements")
    ap.add_argument("--compile-blocks", default="auto")
    ap.add_argument("--trace", default=None, help="Chrome trace of the last step (last batch)")
    ap.add_argument("--json", default=None, help="the record of a single-batch run")
    ap.add_argument("--json-dir", default=None, help="one record per batch: DIR/<prefix>_b<N>.json")
    ap.add_argument("--prefix", default="s5_ssd_w3")
    a = ap.parse_args(argv)
    if a.batches is not None and a.batch is not None:
        ap.error("give --batch or --batches, not both")
    a.batch_list = [int(x) for x in a.batches.split(",") if x] if a.batches else [a.batch or 16]
    if a.json and len(a.batch_list) > 1:
        ap.error("--json names one record: use --json-dir with --batches")
    return a


def _workload(a: argparse.Namespace, batch: int) -> Workload:
    w = WORKLOADS[a.workload]
    config = dict(w.config)
    if a.layers is not None:
        config["num_hidden_layers"] = a.layers
    return Workload(w.name if a.layers is None else f"{w.name}-{a.layers}L", config, a.seq or w.seq, batch)


def _hardware(cuda: bool, read_gbps: float | None, write_gbps: float | None):  # -> HardwareSpec
    from tinypipe.planner.auto import CPU_HARDWARE
    from tinypipe.planner.hardware import HARDWARE

    hw = HARDWARE["h200-pcie5"] if cuda else CPU_HARDWARE
    return dataclasses.replace(hw, ssd_read_gbps=read_gbps or hw.ssd_read_gbps,
                               ssd_write_gbps=write_gbps or hw.ssd_write_gbps)


def choose_plan(a: argparse.Namespace, model_config, w: Workload, devices: list[str], read_gbps: float | None,
                write_gbps: float | None) -> tuple[Candidate, int, int]:
    """The plan to run at ``w``'s batch, as the planner's Candidate (plan with its offload set,
    predicted step time, host need), the DRAM-only host need of the same knobs and the scratch
    bytes of its offload set.

    GPU, no hand-set knobs: the planner's search for the GPU cap, the host budget and the disk
    (free space, at most ``--scratch-gib``). Hand-set knobs (and CPU devices): that plan, with the
    planner's offload set for the budget (:class:`tinypipe.planner.spill.Spill`)."""
    from tinypipe.errors import PlanDoesNotFitError
    from tinypipe.planner.search import evaluate, plan_for
    from tinypipe.planner.sizes import model_sizes
    from tinypipe.planner.spill import Spill

    cuda = devices[0].startswith("cuda")
    precision = "bf16" if cuda else "fp32"
    hw = _hardware(cuda, read_gbps, write_gbps)
    free = free_space(a.offload_dir)
    limit = int(a.scratch_gib * GIB)
    ssd = SsdSpec(hw.ssd_read_gbps, hw.ssd_write_gbps, a.offload_dir,
                  limit if free is None else min(free, limit), source="bench")
    budget = int(a.host_budget_gib * GIB)
    sizes = model_sizes(model_config)
    kw = dict(seq=w.seq, precision=precision, max_grad_norm=a.max_grad_norm)
    if a.pack_size is None and cuda:
        gpu = int(a.cap_gib * GIB) if a.cap_gib > 0 else None
        best = plan_for(model_config, hw, gpus=len(devices), gpu_memory_bytes=gpu, cpu_memory_bytes=budget,
                        global_batch=w.batch, ssd=ssd, hiding_search=False, **kw).best
    else:
        mb = a.micro_batch or 1
        plan = make_plan(sizes.num_blocks, pack_size=a.pack_size or 1, micro_batch_size=mb,
                         backward_micro_batch_size=mb, num_devices=len(devices), prefetch_window=a.window,
                         stash=a.stash, tied=sizes.tied)

        def ev(p: Plan, peaks=None) -> Candidate:
            return evaluate(sizes, hw, p, global_batch=w.batch, peaks=peaks, **kw)

        spill = Spill(sizes, ssd, budget, precision=precision, retain_grads=a.max_grad_norm is not None)
        best = spill.settle(ev(plan), ev)
        if best is None:
            raise PlanDoesNotFitError(spill.why_not() or "the hand-set plan does not fit")
    dram = evaluate(sizes, hw, dataclasses.replace(best.plan, offload=()), global_batch=w.batch, **kw)
    return best, dram.host_need, disk_bytes(sizes, best.plan.offload, precision)


def run_one(a: argparse.Namespace, batch: int, rates, disk: dict | None, read_gbps: float | None,
            write_gbps: float | None, phase) -> dict:
    """One global batch: build the model, plan, run ``--warmup`` + ``--steps`` steps; the record."""
    w = _workload(a, batch)
    devices = a.devices.split(",")
    cuda = devices[0].startswith("cuda")
    results, per_step = [], []
    with RssSampler() as rss:
        rss_before = rss.sample()
        model = build_model(w)
        phase(f"b{batch}: model built")
        cand, host_need, scratch = choose_plan(a, model.config, w, devices, read_gbps, write_gbps)
        plan, est = cand.plan, cand.host_need
        print(f"plan: {plan.describe()}; host need {host_need / GIB:.1f} GiB in DRAM alone, "
              f"{est / GIB:.1f} GiB with the SSD tier (budget {a.host_budget_gib:.0f} GiB), scratch "
              f"{scratch / GIB:.1f} GiB; "
              f"predicted {cand.time.step_s:.2f} s/step", flush=True)
        cfg = tinypipe.Config(devices=devices, precision="bf16" if cuda else "fp32", lr=1e-5,
                              max_grad_norm=a.max_grad_norm, offload_dir=a.offload_dir,
                              cpu_memory_bytes=int(a.host_budget_gib * GIB), compile_blocks=a.compile_blocks,
                              trace=cuda,
                              extra={} if a.read_ahead is None else {"ssd_read_ahead": a.read_ahead})
        engine = tinypipe.Engine(model, cfg, plan=plan)
        del model
        phase(f"b{batch}: engine ready")
        data = make_batch(w)
        for i in range(a.warmup + a.steps):
            r = engine.step(data)
            results.append(r)
            row = {"step": i + 1, "seconds": r.seconds, "tokens_per_s": r.tokens / r.seconds, "loss": r.loss,
                   "ssd_read_bytes": r.ssd_read_bytes, "ssd_write_bytes": r.ssd_write_bytes,
                   "ssd_read_gbps": r.ssd_read_gbps, "ssd_write_gbps": r.ssd_write_gbps,
                   "gpu_peak_reserved": r.device_peak_reserved, "gpu_peak_allocated": r.device_peak_allocated,
                   "rss": rss.sample(), "warmup": i < a.warmup}
            per_step.append(row)
            print(f"step {i + 1}: {r.seconds:.2f} s  {row['tokens_per_s']:,.0f} tok/s  loss {r.loss:.4f}  "
                  f"SSD read {r.ssd_read_bytes / 1e9:.1f} GB ({r.ssd_read_gbps:.2f} GB/s)  write "
                  f"{r.ssd_write_bytes / 1e9:.1f} GB ({r.ssd_write_gbps:.2f} GB/s)  "
                  f"RSS {row['rss'] / GIB:.1f} GiB"
                  f"{'  (warm-up)' if i < a.warmup else ''}", flush=True)
        report = engine.memory_report()
        events = engine.step_timeline()
        if a.trace:
            engine.export_trace(a.trace)
        dec = engine.decomposition
        params = engine.store.param_count
        engine.close()
        del engine
        gc.collect()
    timed = results[a.warmup:] or results
    sec = sum(r.seconds for r in timed) / len(timed)
    read_b = sum(r.ssd_read_bytes for r in timed) / len(timed)
    write_b = sum(r.ssd_write_bytes for r in timed) / len(timed)
    busy = {lane: sum(b - x for x, b in iv) / 1e6 for lane, iv in lane_busy(events).items()}
    compute_busy = sum(v for k, v in busy.items() if is_compute_lane(k))
    bound = {
        "ssd_read_s": read_b / (read_gbps * 1e9) if read_gbps else None,
        "ssd_write_s": write_b / (write_gbps * 1e9) if write_gbps else None,
        "compute_busy_s": compute_busy,
        "optimizer_busy_s": busy.get(str(OPTIMIZER_LANE), 0.0),
    }
    if rates is not None:
        b = step_bound(params, sum(x.param_count for x in dec.blocks), dec.head.param_count, dec.num_blocks,
                       int(w.config["hidden_size"]), w.seq, w.batch, rates)
        bound["compute_s"] = b.compute_s if b.compute_s == b.compute_s else compute_busy
        bound["cpu_optimizer_s"] = b.optimizer_s
    terms = [bound.get("compute_s", compute_busy), bound["ssd_read_s"], bound["ssd_write_s"],
             bound.get("cpu_optimizer_s")]
    bound_s = max((t for t in terms if t is not None), default=None)
    # One drive serves reads and writes in turn: its floor is the step's read + written bytes at the
    # drive's throughput with both in flight (measured), when that is below the serial sum.
    mixed = (disk or {}).get("mixed_gbps")
    serial = (bound["ssd_read_s"] or 0) + (bound["ssd_write_s"] or 0)
    bound["mixed_io_s"] = (read_b + write_b) / (mixed * 1e9) if mixed else None
    one_disk_io = min(t for t in (serial, bound["mixed_io_s"]) if t is not None)
    one_disk_terms = [bound.get("compute_s", compute_busy), one_disk_io, bound.get("cpu_optimizer_s")]
    bound["one_disk_bound_s"] = max(t for t in one_disk_terms if t is not None)
    out = {
        "workload": w.name, "seq": w.seq, "batch": w.batch, "devices": devices, "args": vars(a),
        "plan": plan.as_dict(), "plan_text": plan.describe(), "host_need_dram_only": host_need,
        "scratch_bytes": scratch,
        "host_need_estimate": est, "predicted_step_s": cand.time.step_s,
        "predicted_tokens_per_s": cand.tokens_per_s, "predicted_lanes_s": cand.time.lanes(),
        "predicted_limit": cand.time.limit, "tokens_per_s": w.tokens / sec, "seconds_per_step": sec,
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
    print(f"tokens/s {w.tokens / sec:,.0f}   {sec:.2f} s/step (predicted {cand.time.step_s:.2f})   peak RSS "
          f"{rss.peak / GIB:.2f} GiB   GPU peak reserved {out['gpu_peak_reserved'] / GIB:.2f} GiB, allocated "
          f"{out['gpu_peak_allocated'] / GIB:.2f} GiB")
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
        mio = bound["mixed_io_s"]
        print(f"  one drive: I/O floor {min(out['serial_io_s'], mio or out['serial_io_s']):.2f} s (serial "
              f"{out['serial_io_s']:.2f}, mixed {mio if mio is None else round(mio, 2)}) -> bound "
              f"{bound['one_disk_bound_s']:.2f} s, measured/bound {sec / bound['one_disk_bound_s']:.2f}")
    return out


#: Seconds a run spends outside its steps (7B: model build ~60 s, engine start ~30 s): --time-limit.
SETUP_S = 100.0


def _estimate_s(a: argparse.Namespace, batch: int, read_gbps: float | None,
                write_gbps: float | None) -> float:
    """A run's expected wall time: setup + its steps at the planner's step time x 1.3 (the warm-up
    step compiles)."""
    import transformers

    w = _workload(a, batch)
    cand, _, _ = choose_plan(a, transformers.LlamaConfig(**w.config), w, a.devices.split(","),
                             read_gbps, write_gbps)
    return SETUP_S + 1.3 * (a.warmup + a.steps) * cand.time.step_s


def table(records: list[dict], skipped: list[tuple[int, str]]) -> str:
    """Measured against predicted, one row per batch (printed last)."""
    lines = [f"{'batch':>6} {'tok/s':>8} {'s/step':>8} {'predicted':>9} {'meas/pred':>9} {'bound':>7} "
             f"{'1-drive':>7} {'RSS GiB':>8} {'GPU GiB':>8} {'read GB':>8} {'write GB':>8}  plan"]
    for r in records:
        lines.append(f"{r['batch']:>6} {r['tokens_per_s']:>8,.0f} {r['seconds_per_step']:>8.2f} "
                     f"{r['predicted_step_s']:>9.2f} {r['seconds_per_step'] / r['predicted_step_s']:>9.2f} "
                     f"{(r['bound_s'] or 0):>7.2f} {r['bound'].get('one_disk_bound_s') or 0:>7.2f} "
                     f"{r['peak_rss'] / GIB:>8.1f} "
                     f"{r['gpu_peak_reserved'] / GIB:>8.1f} {r['ssd_read_bytes_per_step'] / 1e9:>8.1f} "
                     f"{r['ssd_write_bytes_per_step'] / 1e9:>8.1f}  {r['plan_text']}")
    for batch, why in skipped:
        lines.append(f"{batch:>6} skipped: {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    t_start = time.perf_counter()

    def phase(name: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f} s] {name}", flush=True)

    os.makedirs(a.offload_dir, exist_ok=True)
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

        disk = measure_rates(a.offload_dir, 4 << 30, mixed=True)
    read_gbps = a.ssd_read_gbps or (disk["read_gbps"] if disk else None)
    write_gbps = a.ssd_write_gbps or (disk["write_gbps"] if disk else None)
    phase(f"rates measured (disk: {read_gbps} / {write_gbps} GB/s read / write)")
    records: list[dict] = []
    skipped: list[tuple[int, str]] = []
    for batch in a.batch_list:
        if a.time_limit > 0:
            expect = _estimate_s(a, batch, read_gbps, write_gbps)
            now = time.perf_counter() - t_start
            if now + expect > a.time_limit:
                skipped.append((batch, f"expected {expect:.0f} s from {now:.0f} s, past --time-limit "
                                       f"{a.time_limit:.0f} s"))
                phase(f"b{batch}: skipped ({skipped[-1][1]})")
                continue
        rec = run_one(a, batch, rates, disk, read_gbps, write_gbps, phase)
        records.append(rec)
        path = a.json or (os.path.join(a.json_dir, f"{a.prefix}_b{batch}.json") if a.json_dir else None)
        if path:
            with open(path, "w") as f:
                json.dump(rec, f, indent=1, default=str)
        phase(f"b{batch}: done")
    print("\n=== measured vs predicted (planner: h200-pcie5 preset, the SSD rates used here) ===")
    print(table(records, skipped))
    phase("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
