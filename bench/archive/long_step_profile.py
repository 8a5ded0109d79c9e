"""Where a long-context QLoRA step's time goes on the GPU: the 8B shape cut to a few blocks, one
row of 64K tokens, the planner's own plan (24 GiB cap), one step under torch.profiler after two
warm-up steps. Prints the step's wall time, the GPU kernels' time by category (attention, matmul,
4-bit dequantization, the rest), the part of the step no kernel ran, and the planner's prediction
of the same step, part by part -- what the time model misses at long sequences (the 2 x 64K
acceptance row ran 20 % under its prediction: bench/results/acceptance/cee9907aabd5).

    PYTHONPATH=.:bench python3 bench/archive/long_step_profile.py [--layers 4] [--seq 65536] [--out DIR]
    PYTHONPATH=.:bench python3 bench/archive/long_step_profile.py --runs 65536:8192:8192,65536:0:8192,65536:8192:0,8192:0:0
    PYTHONPATH=.:bench python3 bench/archive/long_step_profile.py --tiny     # the CPU smoke run

``--runs SEQ:CHUNK:TILE,...`` profiles several settings in one process (CHUNK: the MLP's token
chunk, ``Config.mlp_chunk_tokens``, 0 unchunked; TILE: ``Config.attention_tile_tokens``, 0 whole
segments) and prints one comparison last, every category per 1,000 tokens: the chunked 64K step
against the unchunked one shows what chunking costs, against 8K what the sequence length costs
outside attention, and tiles against whole segments what tiling costs. A setting whose plan
does not fit is reported and skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

GiB = 1024**3
#: kernel name -> category (first match wins)
CATEGORIES = (
    ("link copies", re.compile(r"^Memcpy|^Memset", re.I)),  # the copy engines: beside the compute
    ("attention", re.compile(r"flash|fmha|cudnn|sdpa|attention|softmax", re.I)),
    ("dequantize", re.compile(r"dequant|kDequant|nf4|fp4", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|matmul|sm90_|sm80_", re.I)),
    ("fused (Inductor)", re.compile(r"^triton_")),  # the compiled blocks' and chunks' elementwise work
    ("eager elementwise", re.compile(r"elementwise|reduce_kernel|CatArray|copy|fill|index|scatter|gather", re.I)),
)


def category(name: str) -> str:
    return next((c for c, rx in CATEGORIES if rx.search(name)), "other")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--scheme", default="nf4", help="nf4, fp4 or none (a bf16 base)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--tiny", action="store_true", help="tiny dims on the CPU: checks the script runs")
    ap.add_argument("--out", default=None, help="directory for the JSON summary (and the trace)")
    ap.add_argument("--trace", action="store_true", help="also write the Chrome trace (gzipped) under --out")
    ap.add_argument("--planner-plan", action="store_true",
                    help="the planner's own plan for these few blocks (default: the 32-block row's shape -- "
                         "pack 1, micro-batch 1, host stash, every pack recomputed -- so settings compare)")
    ap.add_argument("--runs", default=None, metavar="SEQ:CHUNK:TILE,...",
                    help="several settings in one process, compared last (see the module doc)")
    return ap.parse_args(argv)


def build(a: argparse.Namespace, device: str):  # -> (model, batch, dtype)
    import torch
    import transformers

    from qlora_bench import SHAPES, TINY
    from qlora_bench import build as build_random
    from tinypipe.lora import LoraSettings, apply_lora

    dims = dict((TINY if a.tiny else SHAPES)["8b"], num_hidden_layers=a.layers)
    cfg = transformers.LlamaConfig(max_position_embeddings=max(131072, a.seq), tie_word_embeddings=False,
                                   rms_norm_eps=1e-5, rope_theta=500000.0, **dims)
    cfg._attn_implementation = "sdpa"
    scheme = None if a.scheme == "none" else a.scheme
    dtype = torch.bfloat16
    model = build_random(cfg, scheme, device, dtype)
    model = apply_lora(model, LoraSettings(rank=a.rank, alpha=2.0 * a.rank, quantize=scheme, compute_dtype="bf16"))
    ids = torch.randint(0, cfg.vocab_size, (1, a.seq), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids}


def kernel_times(prof) -> dict[str, float]:  # noqa: ANN001
    """Seconds of device time per category, from the profiler's per-kernel averages."""
    out: dict[str, float] = {}
    for evt in _kernels(prof):
        us = getattr(evt, "self_device_time_total", 0.0) or 0.0
        if us > 0:
            c = category(evt.key)
            out[c] = out.get(c, 0.0) + us * 1e-6
    return out


def _kernels(prof) -> list:  # noqa: ANN001
    """The device-side events only: a CPU op's row also carries the device time of the kernels it
    launched, so summing every row would count each kernel twice."""
    from torch.autograd import DeviceType

    return [evt for evt in prof.key_averages() if getattr(evt, "device_type", None) == DeviceType.CUDA]


def top_kernels(prof, n: int = 25) -> list[tuple[str, float, int]]:  # noqa: ANN001
    rows = [(evt.key, (getattr(evt, "self_device_time_total", 0.0) or 0.0) * 1e-6, evt.count)
            for evt in _kernels(prof)]
    return sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])[:n]


def profile_one(a: argparse.Namespace, seq: int, chunk: int | None, tile: int | None) -> dict | None:
    """One setting: build, plan, two warm-up steps, one profiled step; its summary (None: the plan
    does not fit, said in one line)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import tinypipe
    from tinypipe.errors import PlanDoesNotFitError

    cuda = torch.cuda.is_available() and not a.tiny
    device = "cuda:0" if cuda else "cpu"
    torch.manual_seed(0)
    a = argparse.Namespace(**{**vars(a), "seq": seq})
    model, batch = build(a, device)
    extra = {} if chunk is None else {"mlp_chunk_tokens": chunk}
    if tile is not None:
        extra["attention_tile_tokens"] = tile
    if not a.planner_plan:  # the acceptance row's plan shape (bench/results/acceptance/*/long-qlora-8b-64k.json)
        extra.update(pack_size=1, micro_batch_size=1, backward_micro_batch_size=1, prefetch_window=1,
                     stash="host", resident_packs=0, keep_activations=False, turn_packs=0)
    config = tinypipe.Config(devices=[device], precision="bf16" if cuda else "fp32", lr=2e-4, weight_decay=0.0,
                             seq_len=seq, global_batch=1, gpu_memory_bytes=int(a.cap_gib * GiB) if cuda else None,
                             **extra)
    label = f"{seq}:{'auto' if chunk is None else chunk}:{'auto' if tile is None else tile}"
    try:
        engine = tinypipe.Engine(model, config)
    except PlanDoesNotFitError as e:
        print(f"{label}: no plan fits: {e}", flush=True)
        return None
    print(f"{label} plan:", engine.plan.describe(), flush=True)
    for i in range(2):
        r = engine.step(batch)
        print(f"  warm-up step {i + 1}: {r.seconds:.2f} s, loss {r.loss:.4f}", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    engine.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        r = engine.step(batch)
        engine.synchronize()
        wall = time.perf_counter() - t0
    if a.out and cuda and a.trace:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(a.out) / f"trace_{label.replace(':', '_')}.json.gz"))
    times = kernel_times(prof) if cuda else {}
    busy = sum(v for k, v in times.items() if k != "link copies")  # the compute stream's kernels
    best = engine.plan_result.best if engine.plan_result is not None else priced(model, config, engine.plan)
    predicted = ({k: v for k, v in dataclasses.asdict(best.time).items() if isinstance(v, float)}
                 if best is not None else {})
    from tinypipe.models.tiled_attention import ATTENTION_TILE_TOKENS
    from tinypipe.planner import work

    summary = {"label": label, "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
               "layers": a.layers, "seq": seq, "mlp_chunk_tokens": engine.config.mlp_chunk_tokens,
               "attention_tile_tokens": tile, "scheme": a.scheme, "plan": engine.plan.describe(),
               # what ran (auto resolved) and the constants the prediction was priced with: what
               # bench/archive/fit_long_overheads.py refits them from
               "mlp_chunk_resolved": engine.mlp_chunk,
               "attention_tile_resolved": (ATTENTION_TILE_TOKENS if engine.attention_tile is None
                                           else engine.attention_tile),
               "priced_with": {"CHUNK_CALL_S": work.CHUNK_CALL_S, "TILE_MERGE_S": work.TILE_MERGE_S},
               "step_s": r.seconds, "wall_s": wall, "kernel_s": times, "kernels_busy_s": busy,
               "idle_s": max(0.0, wall - busy), "predicted": predicted, "top": top_kernels(prof) if cuda else []}
    print(f"\n{summary['gpu']}, {a.layers} blocks of the 8B shape, 1 x {seq:,} tokens, {a.scheme}, {label}")
    print(f"step {r.seconds:.3f} s (profiled wall {wall:.3f} s); kernels {busy:.3f} s; "
          f"no kernel running {summary['idle_s']:.3f} s")
    for name, sec in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<12} {sec:8.3f} s  {100 * sec / max(wall, 1e-9):5.1f} % of the step")
    if predicted:
        print("planner: " + ", ".join(f"{k} {v:.3f}" for k, v in predicted.items() if v))
    for name, sec, count in summary["top"]:
        print(f"  {sec:8.3f} s {count:6d}x  {name[:100]}")
    engine.close()
    del engine, model
    if cuda:
        torch.cuda.empty_cache()
    return summary


def priced(model, config, plan):  # noqa: ANN001, ANN201 -- (nn.Module, Config, Plan) -> Candidate | None
    """The planner's candidate for a hand-set plan: the search for the same workload, then the
    plan priced and sized as the search prices its own (planner/given.py)."""
    from tinypipe.errors import PlanDoesNotFitError
    from tinypipe.planner.auto import hardware_for, request_for
    from tinypipe.planner.given import with_given_plan
    from tinypipe.models.tiled_attention import ATTENTION_TILE_TOKENS
    from tinypipe.planner.search import plan as search

    hw = hardware_for(config)
    # the engine runs a given plan at the configured tile, else the default one
    tile = ATTENTION_TILE_TOKENS if config.attention_tile_tokens is None else config.attention_tile_tokens
    request = dataclasses.replace(request_for(config, model, hw), attention_tile_tokens=tile)
    try:
        return with_given_plan(search(request, hw), plan).best
    except PlanDoesNotFitError as e:
        print(f"  (the planner would not fit this plan: {e})", flush=True)
        return None


def _setting(text: str) -> tuple[int, int | None, int | None]:
    seq, chunk, tile = (text.split(":") + ["", ""])[:3]
    return int(seq), (int(chunk) if chunk not in ("", "auto") else None), (int(tile) if tile not in ("", "auto") else None)


def comparison(summaries: list[dict]) -> str:
    """Milliseconds per 1,000 tokens by kernel category (and idle, and the step), one column per
    setting: what a longer sequence, chunking or tiling adds per token."""
    cats = sorted({c for s in summaries for c in s["kernel_s"]} | {"idle"})
    head = f"{'ms per 1k tokens':<18}" + "".join(f"{s['label']:>20}" for s in summaries)
    lines = [head]
    for c in [*cats, "step"]:
        row = f"{c:<18}"
        for s in summaries:
            sec = s["step_s"] if c == "step" else s["idle_s"] if c == "idle" else s["kernel_s"].get(c, 0.0)
            row += f"{1e6 * sec / s['seq']:>20.3f}"
        lines.append(row)
    row = f"{'planner step':<18}"
    for s in summaries:
        row += f"{1e6 * s['predicted'].get('step_s', 0.0) / s['seq']:>20.3f}"
    lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    a = parse(argv)
    if a.tiny:
        a.seq, a.scheme = min(a.seq, 4096), "none"
    cuda = torch.cuda.is_available() and not a.tiny
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * GiB / total), torch.device("cuda:0"))
    settings = [_setting(t) for t in a.runs.split(",")] if a.runs else [(a.seq, None, None)]
    if a.tiny:
        settings = [(min(seq, 4096), chunk, tile) for seq, chunk, tile in settings]
    summaries: list[dict] = []
    for st in settings:  # written after each setting: a call cut short keeps what it measured
        one = profile_one(a, *st)
        if one is not None:
            summaries.append(one)
        if a.out:
            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "long_step_profile.json").write_text(json.dumps(summaries, indent=1))
    if len(summaries) > 1:
        print("\n" + comparison(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
