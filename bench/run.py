#!/usr/bin/env python3
"""Run a named workload through tinypipe and print tokens/s, memory, losses and the bound analysis.

    python bench/run.py W1 --devices cuda:0 --cap-gib 24 --pack-size 1 --micro-batch 2
    python bench/run.py W1 --auto --clip-compare --max-grad-norm 1.0 --json w1_clip.json

Prints a table last; ``--json FILE`` writes everything, ``--trace FILE`` the last step's
Chrome/Perfetto timeline (per device stream and host worker). Each run prints the planner's
prediction for the plan it ran (the clipped step's when its timed steps clipped), the physical bound
three ways (compute without recompute, with the plan's, with the least the GPU budget forces: JSON
``bound``; with ``--max-grad-norm`` also the host-memory bytes of the forward after a clipped step
and the floor they set, ``bound.clipped_dram``, planner/dram.py) and the last step decomposed into compute, recompute (measured sub-spans with ``--trace``,
else split by the time model), exposed transfers and optimizer, and idle, with its phases next to
the prediction's (JSON ``decomposition``; device times with ``--trace``, host launch times
otherwise). ``--clip-compare`` runs the workload twice in one call, without clipping and then with
``--max-grad-norm`` (default 1.0; each with its own plan under ``--auto``), and prints both with
their predictions and the ratio (JSON: ``runs``, one entry each).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # decompose.py beside this script
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# before CUDA initialises: expandable segments avoid fragmentation from varying activation sizes
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

import tinypipe  # noqa: E402
from benchkit.analysis import is_compute_lane, overlap_table, step_bound  # noqa: E402
from benchkit.keep_limit import KeepLimit  # noqa: E402
from benchkit.rss import RssSampler  # noqa: E402
from benchkit.step_parts import PARTS  # noqa: E402
from benchkit.workloads import WORKLOADS, build_model, make_batch  # noqa: E402
from tinypipe.devices.rates import cpu_adamw_rate, measure  # noqa: E402
from tinypipe.config import DEVICE_OPTIMIZER_CHOICES, PIN_MODES, PRECISIONS  # noqa: E402
from tinypipe.planner.auto import hardware_for, resolve_plan  # noqa: E402
from tinypipe.planner.candidate import Candidate, evaluate  # noqa: E402
from tinypipe.planner.work import UPLOAD_BYTES  # noqa: E402
from tinypipe.planner.dram import clipped_forward_dram  # noqa: E402
from tinypipe.planner.hardware import HardwareSpec  # noqa: E402
from tinypipe.planner.sizes import model_sizes  # noqa: E402
from tinypipe.schedule.plan import Plan  # noqa: E402
from decompose import (pack_recomputes, phases, plan_keep_limit, plan_offload_limit,  # noqa: E402
                       predicted_phases, recompute_share, recomputed_blocks, step_decomposition)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("--devices", default="cuda:0", help="comma-separated, e.g. cuda:0,cuda:0")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="per-process GPU memory cap (GiB); 0 = none")
    ap.add_argument("--pack-size", default="1", help="int or comma-separated sizes")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--bwd-micro-batch", type=int, default=None)
    ap.add_argument("--window", type=int, default=1)
    ap.add_argument("--stash", default="device", help="device | host | comma list per boundary")
    ap.add_argument("--precision", default="bf16", choices=PRECISIONS)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--max-grad-norm", type=float, default=None, help="global-norm clipping (default: off)")
    ap.add_argument("--optimizer-threads", type=int, default=None,
                    help="OpenMP threads of the host optimizer lanes (default: cores - 1 - GPUs)")
    ap.add_argument("--clip-compare", action="store_true",
                    help="run without clipping, then with --max-grad-norm (default 1.0); print both")
    ap.add_argument("--pin", default="register", choices=PIN_MODES)
    ap.add_argument("--device-optimizer", default="off", choices=DEVICE_OPTIMIZER_CHOICES,
                    help="resident layers stepped on the GPU (default: off)")
    ap.add_argument("--resident-packs", type=int, default=0, help="first N packs resident on the GPU")
    ap.add_argument("--assist-every", type=int, default=0, metavar="K",
                    help="add every K-th block the plan steps on the host to Plan.assisted (0: the "
                         "planner's own choice); to measure assisted updates where the planner picks none")
    ap.add_argument("--no-assist", action="store_true",
                    help="every host-stepped layer stepped on the host (Config.assist_updates=False)")
    ap.add_argument("--keep-activations", default="auto", choices=("auto", "on", "off"),
                    help="kept packs (no recompute): the planner's choice, every pack that can, none")
    ap.add_argument("--turn-packs", type=int, default=None, metavar="N",
                    help="micro-batch-wise turn through the last N packs (0: none; default: the "
                         "planner's choice)")
    ap.add_argument("--plan", default=None, metavar="FILE",
                    help="run this plan exactly: a Plan JSON (tinypipe plan --save) or a bench/run.py --json "
                         "result (its \"plan\"), e.g. to rerun a measured plan after a runtime change")
    ap.add_argument("--auto", action="store_true",
                    help="let the engine plan (packing, micro-batches, device optimizer...) for the workload "
                         "and --cap-gib")
    ap.add_argument("--hardware", default=None, help="hardware preset or profile JSON for --auto")
    ap.add_argument("--compile-blocks", default="auto", help="auto | off | a torch.compile backend")
    ap.add_argument("--trace", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-measure", action="store_true", help="skip machine-rate measurement")
    ap.add_argument("--check-finite", action="store_true", help="locate the first NaN/inf (slow: syncs)")
    ap.add_argument("--watchdog", type=float, default=0, help="dump all thread stacks and exit after S s")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.watchdog > 0:
        faulthandler.dump_traceback_later(a.watchdog, exit=True)
    if not a.clip_compare:
        run(a)
        return 0
    clip = a.max_grad_norm if a.max_grad_norm is not None else 1.0
    runs = [run(argparse.Namespace(**{**vars(a), "max_grad_norm": m, "json": None, "trace": None}))
            for m in (None, clip)]
    print(f"\n=== {a.workload}: clipping (max_grad_norm={clip}) vs none ===")
    print("| run | plan | predicted s/step | measured s/step | tokens/s | clipped steps |")
    for r in runs:
        pred = f"{r['predicted_s']:.3f}" if r["predicted_s"] is not None else "-"
        print(f"| {'clip ' + str(clip) if r['clipping'] else 'no clip'} | {r['plan_text']} | {pred} | "
              f"{r['seconds_per_step']:.3f} | {r['tokens_per_s']:,.0f} | "
              f"{r['clipped_steps']}/{r['timed_steps']} |")
    ratio = runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"]
    pr = [r["predicted_s"] for r in runs]
    print(f"clipped / unclipped tokens/s: measured {ratio:.3f}"
          + (f", predicted {pr[0] / pr[1]:.3f}" if None not in pr else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workload": a.workload, "max_grad_norm": clip, "ratio": ratio, "runs": runs}, f,
                      indent=1, default=str)
    return 0


def _load_plan(path: str) -> Plan:
    """A plan from a Plan JSON file or from a ``bench/run.py --json`` result's ``"plan"``."""
    data = json.loads(Path(path).read_text())
    return Plan.from_json(json.dumps(data.get("plan", data) if isinstance(data, dict) and "packs" not in data
                                     else data))


def _clipped_dram(engine: tinypipe.Engine, model: torch.nn.Module, w, hw: HardwareSpec) -> dict:
    """The host-memory bytes of the forward after a clipped step for the plan run
    (:mod:`tinypipe.planner.dram`) and the floor they set at the hardware's ``host_dram_gbs``
    (None where it states none)."""
    sizes = model_sizes(model.config)
    act = 4 if engine.config.precision == "fp32" else 2
    win = clipped_forward_dram(sizes, engine.plan, stash_bytes=w.tokens * sizes.hidden * act,
                               upload_bytes=UPLOAD_BYTES, frozen_bytes=act)
    gbs = hw.host_dram_gbs
    return {"bytes": win.bytes, "host_stepped": win.host_stepped, "assisted": win.assisted, "dram_gbs": gbs,
            "floor_s": win.seconds(gbs) if gbs else None}


def _every_kth_assisted(model: torch.nn.Module, cfg: tinypipe.Config, k: int) -> Plan:
    """The plan the engine would run, with every ``k``-th host-stepped block (layer ids k, 2k, ...)
    assisted -- whatever the planner chose -- to measure what assisting them does."""
    n = int(model.config.num_hidden_layers)
    plan, _ = resolve_plan(model, cfg, num_blocks=n, tied=bool(model.config.tie_word_embeddings))
    on_device = set().union(*(plan.device_optimized(d) for d in range(plan.num_devices)))
    layers = [layer for layer in range(k, n + 1, k) if layer not in on_device]
    return dataclasses.replace(plan, assisted=tuple(sorted(set(plan.assisted) | set(layers))))


def _candidate(engine: tinypipe.Engine, model: torch.nn.Module, w) -> Candidate:
    """The planner's evaluation of the plan the engine runs (predicted step time, memory estimate):
    its own when it chose the plan, else the time model and estimator for the hand-set plan on the
    engine's hardware."""
    planned = engine.plan_result.best if engine.plan_result is not None else None
    if planned is not None:
        return planned
    return evaluate(model_sizes(model.config), hardware_for(engine.config), engine.plan, seq=w.seq,
                    global_batch=w.batch, precision=engine.config.precision,
                    max_grad_norm=engine.config.max_grad_norm)


def _gpu_budget(a: argparse.Namespace, devices: list[str]) -> int | None:
    """Bytes per GPU the plan may use: the cap, else the device's memory; None off CUDA."""
    if not devices[0].startswith("cuda"):
        return None
    if a.cap_gib > 0:
        return int(a.cap_gib * 1024**3)
    return int(torch.cuda.get_device_properties(devices[0]).total_memory)


def _keep_limit(engine: tinypipe.Engine, model: torch.nn.Module, cand: Candidate, w, budget: int | None,
                hw: HardwareSpec) -> KeepLimit:
    """The most blocks whose activations fit beside the plan (the planner's per-token bytes: a
    measured profile's where it has this block shape, as the planner's evaluation takes them)."""
    sizes = model_sizes(model.config)
    precision = engine.config.precision
    act = None
    prof = hw.layer_profile
    if prof is not None and prof.precision == precision:
        act = prof.activation_bytes_for(sizes.block_params[0], sizes.num_heads * sizes.head_dim)
    return plan_keep_limit(engine.plan, cand.memory, budget_bytes=budget, tokens=w.tokens,
                           act_bytes_per_token=act or sizes.block_act_bytes(precision))


def _decomposition(engine: tinypipe.Engine, events: list[dict], step_s: float, cand: Candidate, w,
                   hw: HardwareSpec, device_times: bool) -> dict:
    """The last step in parts (:func:`step_decomposition`) and phases, beside the prediction's."""
    plan = engine.plan
    share = recompute_share(hw, engine.config.precision, w.seq,
                            min(plan.backward_micro_batch_size, w.batch) * w.seq)
    out = step_decomposition(events, step_s, recompute_share=share, recomputes=pack_recomputes(plan))
    compute_busy = sum(busy for lane, busy, _ in overlap_table(events) if is_compute_lane(lane))
    split = "measured" if out["recompute_measured"] else "modelled"
    return out | {"times": "device" if device_times else "host", "recompute_split": split,
                  "phases": phases(events, step_s), "predicted_phases": predicted_phases(cand.time),
                  "predicted_step_s": cand.time.step_s, "compute_lanes_busy_s": compute_busy,
                  "predicted_compute_lanes_s": cand.time.compute_s}


def _print_decomposition(d: dict, planned: bool, cuda: bool) -> None:
    step = d["step_s"]
    how = f"{d['recompute_share']:.2f} of each recomputing bwd task, modelled"
    if d["recompute_measured"]:
        how = f"the {d['recompute_spans']} recompute sub-spans of the bwd tasks, measured"
    print(f"step decomposition (last step, {step:.3f} s, {d['times']} times; recompute = {how}):")
    if cuda and d["times"] == "host":
        print("  (CUDA tasks at their host launch times: pass --trace FILE for device times)")
    print("| part | s/step | share |")
    for part in PARTS:
        s = d["parts"][part]
        if s or part not in ("other compute", "exposed other"):  # those two only when there is any
            print(f"| {part} | {s:.3f} | {s / step:5.1%} |")
    print(f"| total | {sum(d['parts'].values()):.3f} | 100.0% |")
    ph, pred = d["phases"], d["predicted_phases"]
    if ph:
        print(f"phases vs the {'planner' if planned else 'time model'}'s prediction:")
        print("| phase | measured s | predicted s |")
        for name, s in ph.items():
            print(f"| {name} | {s:.3f} | {pred[name]:.3f} |")
        print(f"| compute lanes busy (all devices) | {d['compute_lanes_busy_s']:.3f} | "
              f"{d['predicted_compute_lanes_s']:.3f} |")
        print(f"| step | {step:.3f} | {d['predicted_step_s']:.3f} |")


def run(a: argparse.Namespace) -> dict:
    """One run of the workload as ``a`` says; prints as it goes and returns the JSON record."""
    w = WORKLOADS[a.workload]
    t_start = time.perf_counter()

    def phase(name: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f} s] {name}", flush=True)

    devices = a.devices.split(",")
    cuda = devices[0].startswith("cuda")
    rates = None if a.no_measure else measure(devices[0])
    phase("machine measured")
    if cuda and a.cap_gib > 0:
        for dev in sorted(set(devices)):
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * 1024**3 / total),
                                                       torch.device(dev))
    pack = [int(x) for x in a.pack_size.split(",")]
    stash = a.stash.split(",") if "," in a.stash else a.stash
    results = []
    with RssSampler() as rss:
        rss_before = rss.sample()
        t0 = time.perf_counter()
        model = build_model(w)
        t_build = time.perf_counter() - t0
        phase(f"model built ({t_build:.1f} s)")
        knobs = dict(micro_batch_size=a.micro_batch, backward_micro_batch_size=a.bwd_micro_batch,
                     pack_size=pack[0] if len(pack) == 1 else pack, prefetch_window=a.window, stash=stash,
                     device_optimizer=a.device_optimizer, resident_packs=a.resident_packs)
        if a.auto:  # the engine's own plan for this workload and budget
            knobs = dict(seq_len=w.seq, global_batch=w.batch, hardware=a.hardware,
                         gpu_memory_bytes=int(a.cap_gib * 1024**3) if a.cap_gib > 0 else None)
        keep = {"auto": None, "on": True, "off": False}[a.keep_activations]
        if keep is not None:
            knobs["keep_activations"] = keep
        if a.turn_packs is not None:
            knobs["turn_packs"] = a.turn_packs
        cfg = tinypipe.Config(
            devices=devices, precision=a.precision,
            lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, pin_memory=a.pin,
            max_grad_norm=a.max_grad_norm, optimizer_threads=a.optimizer_threads,
            assist_updates=not a.no_assist,
            trace=a.trace is not None, check_finite=a.check_finite, compile_blocks=a.compile_blocks, **knobs,
        )
        t0 = time.perf_counter()
        plan = _every_kth_assisted(model, cfg, a.assist_every) if a.assist_every else None
        if a.plan:
            plan = _load_plan(a.plan)
        engine = tinypipe.Engine(model, cfg, plan=plan)
        t_engine = time.perf_counter() - t0
        phase(f"engine ready ({t_engine:.1f} s)")
        planned = engine.plan_result.best if engine.plan_result is not None else None
        cand = _candidate(engine, model, w)
        pred_s, pred_clip_s = cand.time.step_s, cand.time.clipped_step_s
        clip_text = "" if pred_clip_s is None else f", {pred_clip_s:.3f} where clipping triggers"
        print(f"plan{' (the planner chose it)' if planned else ''}: {engine.plan.describe()}"
              f" (predicted {pred_s:.3f} s/step{clip_text})", flush=True)
        batch = make_batch(w)
        for i in range(a.warmup + a.steps):
            r = engine.step(batch)
            results.append(r)
            print(f"step {i + 1}: loss {r.loss:.4f}  {r.seconds:.2f} s  {r.tokens / r.seconds:,.0f} tok/s"
                  f"{'  clipped' if r.clipped else ''}{'  (warm-up)' if i < a.warmup else ''}", flush=True)
        report = engine.memory_report()
        events = engine.step_timeline()  # device times when traced
        if a.trace:
            engine.export_trace(a.trace)
    timed = results[a.warmup:]
    # the same probe as the machine measurement's, after the steps: the host's CPU drifts
    adamw_after = None if rates is None else cpu_adamw_rate()
    sec = sum(r.seconds for r in timed) / len(timed)
    tps = w.tokens / sec
    peaks = {}
    if cuda:
        peaks = {"peak_reserved": torch.cuda.max_memory_reserved(devices[0]),
                 "peak_allocated": torch.cuda.max_memory_allocated(devices[0])}
    dec = engine.decomposition
    block_params = sum(b.param_count for b in dec.blocks)
    head_params = dec.head.param_count + (dec.embed.param_count if dec.tied else 0)
    params = engine.store.param_count
    out = {
        "workload": w.name, "devices": devices, "config": {k: str(v) for k, v in vars(a).items()},
        "tokens_per_s": tps, "seconds_per_step": sec, "losses": [r.loss for r in results],
        "steps_s": [r.seconds for r in results], "peak_rss": rss.peak, "rss_before": rss_before,
        "peak_rss_self": rss.peak_self, "peak_rss_children": rss.peak_children,
        "max_children": rss.max_children,
        "build_s": t_build, "engine_init_s": t_engine, "params": params, **peaks,
        "memory_report": report.as_dict(), "torch": torch.__version__,
        "plan": engine.plan.as_dict(), "plan_text": engine.plan.describe(), "planned": planned is not None,
        "predicted_s": planned.time.step_s if planned is not None else None,
        "predicted_step_s": pred_s, "predicted_clipped_step_s": pred_clip_s,
        "clipping": a.max_grad_norm is not None, "timed_steps": len(timed),
        "clipped_steps": sum(bool(r.clipped) for r in timed),
    }
    # the prediction for what the timed steps did: the clipped step's when most of them clipped
    out["predicted_s"] = pred_clip_s if pred_clip_s is not None and out["clipped_steps"] * 2 > len(timed) \
        else pred_s
    print(report.to_text())
    bound = None
    hw = hardware_for(engine.config)
    limit = _keep_limit(engine, model, cand, w, _gpu_budget(a, devices), hw)
    out["bound"] = {"keep_limit": limit.as_dict()}
    dram = None
    if a.max_grad_norm is not None:  # the forward after a clipped step: its host-memory traffic
        dram = _clipped_dram(engine, model, w, hw)
        out["bound"]["clipped_dram"] = dram
    if rates is not None:
        bound = step_bound(params, block_params, head_params, dec.num_blocks, int(model.config.hidden_size),
                           w.seq, w.batch, rates,
                           recompute_fraction=recomputed_blocks(engine.plan) / dec.num_blocks,
                           forced_fraction=limit.forced_fraction)
        out["rates"] = rates.as_dict() | {"adamw_gparams_s_after": adamw_after}
        out["bound"] = bound.as_dict() | out["bound"]
    decomposition = None
    offload_text = None
    if events:
        out["overlap"] = overlap_table(events)
        decomposition = _decomposition(engine, events, results[-1].seconds, cand, w, hw,
                                       device_times=cfg.trace and cuda)
        out["decomposition"] = decomposition
        if rates is not None:  # what offloading activations instead of recomputing could save here
            off = plan_offload_limit(events, results[-1].seconds, limit=limit,
                                     recompute_s=decomposition["parts"]["recompute"],
                                     recomputed=recomputed_blocks(engine.plan),
                                     d2h_gbs=rates.d2h_gbs, h2d_gbs=rates.h2d_gbs, devices=len(set(devices)))
            if off is not None:
                out["bound"]["offload_limit"] = off.as_dict()
                offload_text = off.describe(results[-1].seconds)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    gib = 1024**3
    print("\n=== tinypipe", w.name, "===")
    if rates is not None:
        print(f"machine: {rates.device_name}  H2D {rates.h2d_gbs:.1f} GB/s  D2H {rates.d2h_gbs:.1f} GB/s  "
              f"both {rates.both_gbs:.1f} GB/s  bf16 mm {rates.matmul_tflops:.0f} TFLOP/s  "
              f"CPU AdamW {rates.adamw_gparams_s:.2f} Gparam/s ({adamw_after:.2f} after the steps)")
    print(f"losses: {' '.join(f'{r.loss:.4f}' for r in results)}")
    if events:
        print("lane busy (last step):  lane, busy s, fraction overlapped with compute")
        for lane, busy, hid in out["overlap"]:
            print(f"  {lane:<18} {busy:7.3f} s  {hid * 100:5.1f}%")
    if bound is not None:
        for name, s in bound.rows():
            print(f"  bound {name:<14} {s:7.3f} s")
        print(f"  physical bound {bound.bound_s:.3f} s/step -> measured/bound = {sec / bound.bound_s:.2f}")
        if bound.compute_s == bound.compute_s:  # a matmul rate was measured (CUDA)
            for name, s in bound.compute_rows():
                print(f"  {name:<44} {s:7.3f} s")
            print(f"  ceiling (no recompute) {bound.ceiling_s:.3f} s/step -> measured/ceiling = "
                  f"{sec / bound.ceiling_s:.2f}")
            if bound.forced_bound_s is not None:
                print(f"  bound with only the recompute memory forces {bound.forced_bound_s:.3f} s/step "
                      f"-> measured/that = {sec / bound.forced_bound_s:.2f}")
    print(f"  memory: {limit.describe()}")
    if dram is not None:
        floor = f" -> at least {dram['floor_s']:.3f} s at {dram['dram_gbs']:g} GB/s" if dram["floor_s"] else ""
        fwd = (decomposition or {}).get("phases", {}).get("forward")
        seen = f" (measured forward phase {fwd:.3f} s)" if fwd is not None else ""
        print(f"  after a clipped step the forward moves {dram['bytes'] / 1e9:.1f} GB through host memory"
              f"{floor}{seen}")
    if offload_text is not None:
        print(f"  {offload_text}")
    if decomposition is not None:
        _print_decomposition(decomposition, planned is not None, cuda)
    print(f"host RSS peak: process {rss.peak_self / gib:.2f} GiB, children {rss.peak_children / gib:.2f} GiB "
          f"(up to {rss.max_children} child processes)")
    print(f"| workload | tokens/s | s/step | peak GPU reserved | peak GPU allocated | peak host RSS |")
    print(f"| {w.name} | {tps:,.0f} | {sec:.3f} | {peaks.get('peak_reserved', 0) / gib:.2f} GiB | "
          f"{peaks.get('peak_allocated', 0) / gib:.2f} GiB | {rss.peak / gib:.2f} GiB |")
    print(f"predicted {out['predicted_s']:.3f} s/step for these steps ({out['clipped_steps']} of "
          f"{len(timed)} clipped): measured/predicted = {sec / out['predicted_s']:.3f}")
    engine.close()
    return out


if __name__ == "__main__":
    raise SystemExit(main())
