#!/usr/bin/env python3
"""QLoRA on one GPU: a Llama-3.1-70B shape over an NF4 base, and an 8B shape NF4 vs bf16 LoRA.

    python bench/qlora_bench.py --runs 70b-shape-nf4 --dequant --json results/qlora_70b.json
    python bench/qlora_bench.py --runs 8b-shape-nf4,8b-shape-bf16-lora --json results/qlora_8b.json
    python bench/qlora_bench.py --runs 70b-shape-nf4 --layers 4 --steps 1     # a small dry run
    python bench/qlora_bench.py --tiny --device cpu --steps 2                 # the CPU smoke test

(Defaults: cuda:0 capped at 24 GiB, 64 GiB host budget. Expected on an H200 box: the 70B run
~5-7 minutes -- building its random NF4 base on the GPU ~1, the engine ~1, the first step
compiles --, the two 8B runs ~2-3 minutes each: run the 70B shape in a call of its own.)

Runs (each in a fresh child process, so host and GPU peaks are its own):

* ``70b-shape-nf4`` -- 80 blocks, hidden 8192, intermediate 28672, GQA 64/8 heads, vocab 128256;
  random weights generated block linear by block linear on the device and quantized there
  (NF4, double quantization), so the host only ever holds the quantized model; LoRA rank 16 on
  every projection; seq 2048, 16 sequences per step;
* ``8b-shape-nf4`` and ``8b-shape-bf16-lora`` -- Llama-3.1-8B (32 blocks, hidden 4096, intermediate
  14336, GQA 32/8, vocab 128256) with the same adapters over an NF4 base and over a bf16 base.

The engine plans for itself (``Config(seq_len, global_batch, gpu_memory_bytes,
cpu_memory_bytes)``) as ``tinypipe finetune`` does; the planner's prediction (tokens/s, GPU and
host need) is reported next to each measurement. Each child reports tokens/s (mean over the
measured steps, after ``--warmup``), the GPU allocator peak, the host peak (VmHWM, reset after the
imports) and the build time; ``--dequant`` also times bitsandbytes' NF4 dequantization kernel on
a (28672, 8192) weight next to the planner's constant. ``--layers N`` runs every shape with N
blocks (a quick dry run); ``--tiny`` runs tiny shapes (CPU tests). A table is printed last;
``--json FILE`` writes every run's record.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

GiB = 1024**3

SHAPES = {
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                num_hidden_layers=80, vocab_size=128256),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               num_hidden_layers=32, vocab_size=128256),
}
TINY = {
    "70b": dict(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=3, vocab_size=512),
    "8b": dict(hidden_size=32, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, vocab_size=512),
}
RUNS = {  # name -> (shape, quantization scheme or None for a bf16 base)
    "70b-shape-nf4": ("70b", "nf4"),
    "8b-shape-nf4": ("8b", "nf4"),
    "8b-shape-bf16-lora": ("8b", None),
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--gpu-memory", default="24GiB", help="GPU cap and planning budget (0: the GPU's)")
    ap.add_argument("--cpu-memory", default="64GiB", help="host budget the plan must fit")
    ap.add_argument("--hardware", default=None, help="planner hardware preset (default: from the GPU name)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; --tiny 32)")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="sequences per step (default 16; --tiny 4)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=None, help="blocks of every shape (a small dry run)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--compile-blocks", default="auto")
    ap.add_argument("--dequant", action="store_true", help="time bitsandbytes' NF4 dequantization (GPU)")
    ap.add_argument("--json", default=None, help="write all runs' records here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# --------------------------------------------------------------------------- host peak


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _hwm() -> int:
    import psutil

    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(psutil.Process().memory_info().rss)


# --------------------------------------------------------------------------- random models


def _config(shape: str, args: argparse.Namespace):  # -> transformers.LlamaConfig
    import transformers

    dims = dict((TINY if args.tiny else SHAPES)[shape])
    if args.layers is not None:
        dims["num_hidden_layers"] = args.layers
    cfg = transformers.LlamaConfig(max_position_embeddings=max(4096, args.seq), tie_word_embeddings=False,
                                   rms_norm_eps=1e-5, rope_theta=500000.0, **dims)
    cfg._attn_implementation = "sdpa"
    return cfg


def _random(shape: tuple[int, ...], device: str, dtype, std: float):  # noqa: ANN001
    import torch

    return (torch.randn(shape, device=device, dtype=torch.float32) * std).to(dtype)


def build(cfg, scheme: str | None, device: str, dtype):  # noqa: ANN001, ANN201
    """The random model: block linears generated on ``device`` and (``scheme``) quantized there, one
    at a time; everything else generated there and kept on the host at ``dtype``."""
    import torch
    from torch import nn

    from tinypipe.models.skeleton import build_skeleton
    from tinypipe.quant.load import _materialise, _release_freed
    from tinypipe.quant.model import empty_module, install, mark, quantizable_linears, quantize_weight
    from tinypipe.quant.spec import spec_for

    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    spec = spec_for(scheme, precision) if scheme else None
    model = build_skeleton(cfg)
    linears = quantizable_linears(model)
    std = 0.02
    for full in linears:
        parent, _, attr = full.rpartition(".")
        owner = model.get_submodule(parent)
        old = getattr(owner, attr)
        w = _random((old.out_features, old.in_features), device, dtype, std)
        if spec is not None:
            new = empty_module(old, spec)
            install(new, quantize_weight(w, spec, device))
            setattr(owner, attr, new)
        else:
            old.weight = nn.Parameter(w.cpu(), requires_grad=old.weight.requires_grad)
        del w
        _release_freed()
    weights = {f"{m}.weight" for m in linears}
    _materialise(model, dtype, weights)  # embedding, norms, head: host tensors at the compute dtype
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in weights:
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(_random(tuple(p.shape), device, dtype, std).cpu())
    if spec is not None:
        mark(model, spec)
    model.eval()
    return model


# --------------------------------------------------------------------------- one run (child)


def _dequant_rate(device: str) -> dict:
    """Seconds per element of bitsandbytes' NF4 (double-quant) dequantization on a 70B MLP weight."""
    import torch
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    w = torch.randn(28672, 8192, device=device, dtype=torch.bfloat16)
    packed, qs = quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    del w
    for _ in range(3):
        dequantize_4bit(packed, qs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reps = 20
    for _ in range(reps):
        dequantize_4bit(packed, qs)
    torch.cuda.synchronize()
    from tinypipe.quant.cost import DEQUANT_S_PER_PARAM

    s = (time.perf_counter() - t0) / reps / (28672 * 8192)
    return {"measured_s_per_param": s, "planner_s_per_param": DEQUANT_S_PER_PARAM}


def child(args: argparse.Namespace) -> dict:
    import torch

    import tinypipe
    from tinypipe.lora import LoraSettings, apply_lora
    from tinypipe.planner.hardware import parse_bytes
    from tinypipe.quant.spec import require_bitsandbytes

    name = args.child
    shape, scheme = RUNS[name]
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    precision = "bf16" if cuda else "fp32"
    require_bitsandbytes()
    import peft  # noqa: F401 - imported before the baseline
    import transformers  # noqa: F401

    gpu_budget = parse_bytes(args.gpu_memory) if args.gpu_memory not in ("0", "", "none") else None
    if cuda and gpu_budget:
        dev = torch.device(args.device)
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_budget / total), dev)
    torch.manual_seed(0)
    cfg = _config(shape, args)
    gc.collect()
    hwm_ok = _reset_hwm()
    import psutil

    rss0 = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    model = build(cfg, scheme, args.device, dtype)
    build_s = time.perf_counter() - t0
    after_build = _hwm()
    if cuda:
        torch.cuda.empty_cache()  # the generator's scratch: not the engine's budget
    settings = LoraSettings(rank=args.rank, alpha=2.0 * args.rank, quantize=scheme, compute_dtype=precision)
    pm = apply_lora(model, settings)
    config = tinypipe.Config(devices=[args.device], precision=precision, lr=1e-4, seq_len=args.seq,
                             global_batch=args.global_batch, gpu_memory_bytes=gpu_budget,
                             cpu_memory_bytes=parse_bytes(args.cpu_memory), hardware=args.hardware,
                             compile_blocks=args.compile_blocks)
    t1 = time.perf_counter()
    engine = tinypipe.Engine(pm, config)
    engine_s = time.perf_counter() - t1
    g = torch.Generator().manual_seed(1)

    def batch_of() -> dict:
        return {"input_ids": torch.randint(0, cfg.vocab_size, (args.global_batch, args.seq), generator=g)}

    results = []
    for i in range(args.warmup + args.steps):
        r = engine.step(batch_of())
        if i >= args.warmup:
            results.append(r)
    engine.synchronize()
    best = engine.plan_result.best if engine.plan_result is not None else None
    report = engine.memory_report()
    tokens = sum(r.tokens for r in results)
    seconds = sum(r.seconds for r in results)
    out = dict(
        name=name, shape=shape, scheme=scheme or "bf16", layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
        seq=args.seq, global_batch=args.global_batch, rank=args.rank, device=args.device,
        gpu_name=torch.cuda.get_device_name(torch.device(args.device)) if cuda else "cpu",
        tokens_per_s=tokens / seconds, step_s=[r.seconds for r in results], losses=[r.loss for r in results],
        gpu_peak_allocated=max(r.device_peak_allocated for r in results),
        gpu_peak_reserved=max(r.device_peak_reserved for r in results),
        host_peak_bytes=_hwm() - rss0, host_peak_after_build=after_build - rss0,
        host_peak_source="VmHWM" if hwm_ok else "rss", build_s=build_s, engine_s=engine_s,
        plan=engine.plan.describe(),
        plan_settings=engine.plan.as_dict(),  # what ran (engine.config is what was given)
        memory_host=report.host, memory_devices=report.devices,
        predicted=dict(tokens_per_s=best.time.tokens_per_s, step_s=best.time.step_s, gpu_need=best.gpu_need,
                       host_need=best.host_need, host=best.memory.host) if best is not None else None,
    )
    if args.dequant and cuda:
        out["dequant"] = _dequant_rate(args.device)
    engine.close()
    return out


# --------------------------------------------------------------------------- parent


def _table(runs: list[dict]) -> str:
    head = (f"{'run':<20} {'layers':>6} {'tok/s':>9} {'pred':>9} {'err':>6} {'GPU peak':>9} {'pred':>8} "
            f"{'host peak':>10} {'pred':>8}  plan")
    lines = [head]
    for r in runs:
        p = r.get("predicted") or {}
        err = (p["tokens_per_s"] / r["tokens_per_s"] - 1) * 100 if p else float("nan")
        lines.append(f"{r['name']:<20} {r['layers']:>6} {r['tokens_per_s']:>9,.0f} "
                     f"{p.get('tokens_per_s', 0):>9,.0f} {err:>5.0f}% {r['gpu_peak_reserved'] / GiB:>8.1f}G "
                     f"{p.get('gpu_need', 0) / GiB:>7.1f}G {r['host_peak_bytes'] / GiB:>9.1f}G "
                     f"{p.get('host_need', 0) / GiB:>7.1f}G  {r.get('plan')}")
    lines.append("(tok/s: measured mean after warm-up; pred: the planner's prediction for the plan it chose; "
                 "GPU peak: allocator reserved; host peak: VmHWM growth over the run)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.seq = args.seq or (32 if args.tiny else 2048)
    args.global_batch = args.global_batch or (4 if args.tiny else 16)
    if args.child:
        out = child(args)
        with open(args.child_out, "w") as fh:
            json.dump(out, fh, default=str)
        return 0
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        print(f"unknown run(s) {', '.join(unknown)}; choose from {', '.join(RUNS)}", file=sys.stderr)
        return 2
    runs = []
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    for name in names:
        out_file = f"{args.json or 'qlora_bench'}.{name}.child.json"
        cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--child", name,
               "--child-out", out_file]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd)
        if proc.returncode != 0:
            print(f"{name}: failed (exit {proc.returncode}) after {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr)
            continue
        with open(out_file) as fh:
            rec = json.load(fh)
        os.unlink(out_file)
        print(json.dumps(rec, default=str), flush=True)
        runs.append(rec)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "runs": runs}, fh, indent=1, default=str)
    print(_table(runs))
    return 0 if len(runs) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
