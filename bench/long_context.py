#!/usr/bin/env python3
"""Long context on one GPU capped at 24 GiB (issue #32): real-shape Llama models, random weights,
two sequences per step, the planner choosing every plan (chunked MLP and head, host-stashed block
inputs), as ``tinypipe finetune --seq-len N`` runs them.

    python3 bench/long_context.py --commit SHA                      # the default rows, <= ~9 min
    python3 bench/long_context.py --rows 8b-full-64k,8b-qlora-128k  # chosen rows, in that order
    python3 bench/long_context.py --plan-only                       # the planner's table alone (CPU)
    python3 bench/long_context.py --tiny --in-process               # the CPU smoke test (tests/)

First the planner plans every selected row on the CPU (seconds each) against the GPU cap and the
host's RAM: a row it refuses is recorded as skipped with its one-line reason, and the longest
sequence that fits (``8b-full-longest``: multiples of 8192) is found there. Then the rows run in
the order given, each in a child process of its own (its GPU and host peaks are its own), as long
as the time budget (``--budget-s``) holds the row's estimate (a fixed overhead for building the
model, the engine and the first step's compile, plus the planner's step time per step); a row that
would not fit is skipped, saying so. Each row writes one raw JSON under
``bench/results/long_context/<commit>/<row>.json`` (``--out`` elsewhere): tokens/s, model TFLOPS
(Megatron's formula with causal attention, :func:`model_flops`; recompute not counted), the
allocator's reserved and allocated peaks, the host RSS peak, the MLP chunk, the plan, and the
planner's prediction beside them (step time, GPU and host need). A table is printed last.

The 2K reference (``8b-full-2k``) runs 16 x 2048 tokens: the issue's goal is 128K at >= 0.8x its
model TFLOPS. Sequences are single documents except in ``8b-full-64k-packed`` (8 documents per
row, position ids restarting): above 16K tokens the engine attends per document without
transformers' dense [B, 1, S, S] mask (segment attention, docs/long_context.md), which at 64K
would take 4 GiB per row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

ROOT = Path(__file__).resolve().parents[1]
GiB = 1024**3
K = 1024

#: real shapes (Llama-3.1-8B, Llama-3.2-3B) and their tiny stand-ins for the CPU test
SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               num_hidden_layers=32, vocab_size=128256, tie_word_embeddings=False),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
               num_hidden_layers=28, vocab_size=128256, tie_word_embeddings=True),
}
TINY = {
    "8b": dict(hidden_size=64, intermediate_size=224, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, vocab_size=512, tie_word_embeddings=False),
    "3b": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, vocab_size=512, tie_word_embeddings=True),
}
TINY_MLP_CHUNK = 16  # tokens: the tiny rows chunk their MLPs too (the automatic choice is off below 16K)


@dataclasses.dataclass(frozen=True)
class Row:
    """One run: ``shape`` at ``seq`` tokens x ``batch`` sequences; ``lora``: None (full
    fine-tuning) or ``"nf4"`` (QLoRA rank 16 on every projection). ``seq`` 0: the longest
    multiple of 8192 the planner fits (found before the runs). ``overhead_s``: building the model
    and the engine and the first step's compile on the H200 (estimated; the budget adds it)."""

    shape: str
    seq: int
    batch: int = 2
    lora: str | None = None
    warmup: int = 1
    steps: int = 1
    overhead_s: float = 100.0
    docs: int = 1  # documents packed per row (position ids restart): segment attention, no mask
    #: the SSD tier (``--offload-dir``, rates measured in the call) with at most ``cpu_gib`` of
    #: host memory: where the full fine-tuning's optimizer state and the host-stashed block inputs
    #: together exceed the host's RAM (8B at 2 x 128K: ~157 GiB)
    offload: bool = False
    cpu_gib: float | None = None


#: name -> row, in the default order: most important first (the planner's refusals cost nothing)
ROWS: dict[str, Row] = {
    "8b-full-128k": Row("8b", 128 * K),
    "8b-full-128k-ssd": Row("8b", 128 * K, offload=True, cpu_gib=120.0, overhead_s=140.0),
    "8b-full-64k": Row("8b", 64 * K),
    "8b-qlora-128k": Row("8b", 128 * K, lora="nf4", overhead_s=80.0),
    "8b-full-8k": Row("8b", 8 * K),
    "8b-full-longest": Row("8b", 0),
    "3b-full-128k": Row("3b", 128 * K, overhead_s=70.0),
    "8b-qlora-64k": Row("8b", 64 * K, lora="nf4", overhead_s=80.0),
    "8b-full-32k": Row("8b", 32 * K),
    "8b-qlora-256k": Row("8b", 256 * K, lora="nf4", overhead_s=80.0),
    "8b-qlora-256k-ssd": Row("8b", 256 * K, lora="nf4", offload=True, overhead_s=120.0),
    # one sequence, as Unsloth's published 24 GB figure (78K tokens) is measured
    "8b-qlora-256k-b1": Row("8b", 256 * K, batch=1, lora="nf4", overhead_s=80.0),
    "8b-full-2k": Row("8b", 2 * K, batch=16, warmup=1, steps=2),
    "8b-full-64k-packed": Row("8b", 64 * K, docs=8),
}


# --------------------------------------------------------------------------- model FLOPs


def model_flops(dims: dict, seq: int, batch: int, causal: bool = True, docs: int = 1) -> float:
    """Model FLOPs of one training step (forward + backward = 3 x forward; recompute not
    counted), Megatron-LM's accounting (Narayanan et al. 2021, ``72 B s l h^2 (1 + s/6h + V/12lh)``
    for GPT) generalised to grouped-query attention and gated MLPs: 2 FLOPs per multiply-add of
    every block matmul and the LM head, and attention's QK^T and AV, ``4 s^2 d`` per layer and
    sequence forward for ``d`` = heads x head dim -- half of it with ``causal`` masking (the
    FlashAttention convention); with ``docs`` equal documents per row, attention within each
    (``docs`` x a document's square). Embedding lookups, norms and softmax are not counted."""
    h = dims["hidden_size"]
    heads = dims["num_attention_heads"]
    kv = dims.get("num_key_value_heads", heads)
    hd = dims.get("head_dim") or h // heads
    inter = dims["intermediate_size"]
    layers = dims["num_hidden_layers"]
    vocab = dims["vocab_size"]
    gated = dims.get("gated", True)
    attn_params = h * heads * hd * 2 + h * kv * hd * 2  # q, o; k, v
    mlp_params = (3 if gated else 2) * h * inter
    tokens = batch * seq
    matmul = 2.0 * tokens * (layers * (attn_params + mlp_params) + vocab * h)
    doc = -(-seq // max(1, docs))
    attention = 4.0 * doc * seq * heads * hd * layers * batch * (0.5 if causal else 1.0)
    return 3.0 * (matmul + attention)


# --------------------------------------------------------------------------- planning (parent)


def _dims(row: Row, tiny: bool) -> dict:
    return dict((TINY if tiny else SHAPES)[row.shape])


def _config(row: Row, seq: int, tiny: bool):  # -> transformers.LlamaConfig
    import transformers

    cfg = transformers.LlamaConfig(max_position_embeddings=max(131072, seq), rms_norm_eps=1e-5,
                                   rope_theta=500000.0, **_dims(row, tiny))
    cfg._attn_implementation = "sdpa"
    return cfg


def _lora_settings(row: Row, tiny: bool):  # -> LoraSettings | None
    if row.lora is None:
        return None
    from tinypipe.lora import LoraSettings

    return LoraSettings(rank=16, alpha=32.0, quantize=row.lora, compute_dtype="fp32" if tiny else "bf16")


def _document_tokens(row: Row, seq: int) -> int | None:
    """The planner's attention span for the row's packed documents (None: one per row)."""
    return -(-seq // row.docs) if row.docs > 1 else None


def plan_row(row: Row, seq: int, a: argparse.Namespace) -> dict[str, Any]:
    """The planner's answer for ``row`` at ``seq`` tokens: the prediction, or the refusal."""
    from tinypipe.errors import PlanDoesNotFitError
    from tinypipe.planner.search import plan_for

    try:
        r = plan_for(_config(row, seq, a.tiny), a.hardware, gpus=1, gpu_memory_bytes=int(a.cap_gib * GiB),
                     cpu_memory_bytes=int(_host_gib(row, a) * GiB), seq=seq, global_batch=row.batch,
                     precision="fp32" if a.tiny else "bf16", lora=_lora_settings(row, a.tiny),
                     mlp_chunk_tokens=TINY_MLP_CHUNK if a.tiny else None, ssd=_ssd_spec(row, a),
                     document_tokens=_document_tokens(row, seq), attention_tile_tokens=a.attention_tile_tokens)
    except PlanDoesNotFitError as exc:
        return {"fits": False, "reason": " ".join(str(exc).split())}
    b = r.best
    return {"fits": True, "plan": b.describe(), "step_s": b.time.step_s, "tokens_per_s": b.time.tokens_per_s,
            "gpu_need": b.gpu_need, "host_need": b.host_need, "mlp_chunk_tokens": r.mlp_chunk_tokens,
            "attention_tile_tokens": r.attention_tile_tokens,
            "activations_peak": max(c.get("activations_peak", 0) for c in b.memory.devices.values()),
            "host": dict(b.memory.host)}


def _host_gib(row: Row, a: argparse.Namespace) -> float:
    """The host memory the row plans and runs with: the machine's (``--cpu-gib``), or less."""
    return a.cpu_gib if row.cpu_gib is None else min(a.cpu_gib, row.cpu_gib)


def _ssd_spec(row: Row, a: argparse.Namespace):  # -> SsdSpec | None
    """The SSD tier an offload row plans with: the rates of ``--hardware`` (measured by
    :func:`ssd_hardware` before a real run; the preset's stated ones for ``--plan-only``)."""
    if not row.offload:
        return None
    from tinypipe.planner.hardware import load_hardware
    from tinypipe.planner.ssd import SsdSpec

    hw = load_hardware(a.hardware)
    return SsdSpec(read_gbps=hw.ssd_read_gbps, write_gbps=hw.ssd_write_gbps, mixed_gbps=hw.ssd_mixed_gbps,
                   directory=a.offload_dir if os.path.isdir(a.offload_dir) else None, source=hw.name)


def ssd_hardware(a: argparse.Namespace, out_dir: Path) -> str:
    """A hardware file: ``--hardware`` with ``--offload-dir``'s direct-I/O rates measured now (4 GiB
    written and read back, and both together), so the plans of the SSD rows price this disk."""
    from tinypipe.cli.profile import ssd_rates
    from tinypipe.planner.hardware import load_hardware

    os.makedirs(a.offload_dir, exist_ok=True)
    rates = ssd_rates([a.offload_dir], 4 << 30)
    spec = load_hardware(a.hardware).as_dict()
    spec.update(name=f"{spec['name']} (disk measured)", ssd_read_gbps=rates["ssd_read_gbps"],
                ssd_write_gbps=rates["ssd_write_gbps"], ssd_mixed_gbps=rates["ssd_mixed_gbps"])
    path = out_dir / "hardware.json"
    path.write_text(json.dumps(spec, indent=1))
    return str(path)


def longest(row: Row, a: argparse.Namespace, lo: int = 16 * K, hi: int = 128 * K,
            step: int = 8 * K) -> tuple[int, dict[str, Any]]:
    """The longest multiple of ``step`` in [lo, hi] the planner fits (bisection), and its plan;
    (0, the refusal at ``lo``) when even ``lo`` does not fit. Both budgets bind: on a 128 GiB host
    the 8B shape's fp32 master and moments (90 GiB) leave ~16 GiB for host-stashed block inputs,
    64K tokens' worth for two sequences."""
    if a.tiny:
        lo, hi, step = 32, 256, 32
    best = plan_row(row, lo, a)
    if not best["fits"]:
        return 0, best
    good, bad = lo, hi + step
    while bad - good > step:
        mid = (good + bad) // 2 // step * step
        p = plan_row(row, mid, a)
        if p["fits"]:
            good, best = mid, p
        else:
            bad = mid
    return good, best


def row_seq(row: Row, tiny: bool) -> int:
    """The row's sequence length (tiny: scaled down so the CPU test runs in seconds)."""
    return max(32, row.seq // 1024) if tiny else row.seq


# --------------------------------------------------------------------------- one row (child)


def _build(row: Row, seq: int, device: str, tiny: bool):  # -> (model, batch)
    import torch

    from qlora_bench import build

    cfg = _config(row, seq, tiny)
    dtype = torch.float32 if tiny else torch.bfloat16
    if cfg.tie_word_embeddings:  # qlora_bench's builder keeps the embedding and head apart
        from benchkit.workloads import Workload, build_model

        model = build_model(Workload(row.shape, dict(_dims(row, tiny), max_position_embeddings=max(131072, seq),
                                                     rope_theta=500000.0), seq, row.batch))
    else:
        model = build(cfg, row.lora, device, dtype)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    if row.lora is not None:
        from tinypipe.lora import apply_lora

        model = apply_lora(model, _lora_settings(row, tiny))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (row.batch, seq), generator=g)
    if row.docs <= 1:
        return model, {"input_ids": ids}
    # ``docs`` documents per row: position ids restart at each (a dense mask would be S x S)
    pos = torch.arange(seq) % -(-seq // row.docs)
    return model, {"input_ids": ids, "position_ids": pos.expand(row.batch, seq).clone()}


def run_row(name: str, row: Row, seq: int, a: argparse.Namespace) -> dict[str, Any]:
    """Build, train ``warmup + steps`` steps, measure (see the module doc)."""
    import torch

    import tinypipe
    from benchkit.rss import RssSampler

    device = "cpu" if a.tiny else "cuda:0"
    cuda = device.startswith("cuda")
    cap = int(a.cap_gib * GiB)
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), torch.device(device))
    torch.manual_seed(0)
    with RssSampler() as rss:
        t0 = time.perf_counter()
        model, batch = _build(row, seq, device, a.tiny)
        build_s = time.perf_counter() - t0
        if a.tiny:  # a hand-set plan on the CPU, MLPs chunked as a long run's are
            config = tinypipe.Config(devices=[device], precision="fp32", lr=1e-4, pack_size=1, micro_batch_size=1,
                                     mlp_chunk_tokens=TINY_MLP_CHUNK, compile_blocks="off",
                                     segment_attention=row.docs > 1 or None)
        else:
            ssd: dict[str, Any] = {}
            if row.offload:
                ssd = dict(offload_dir=a.offload_dir, cpu_memory_bytes=int(_host_gib(row, a) * GiB),
                           hardware=a.hardware)
            config = tinypipe.Config(devices=[device], precision="bf16", lr=1e-5, seq_len=seq,
                                     global_batch=row.batch, gpu_memory_bytes=cap,
                                     document_tokens=_document_tokens(row, seq),
                                     attention_tile_tokens=a.attention_tile_tokens, **ssd)
        t1 = time.perf_counter()
        engine = tinypipe.Engine(model, config)
        engine_s = time.perf_counter() - t1
        results = []
        for i in range(row.warmup + row.steps):
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            r = engine.step(batch)
            results.append(r)
            print(f"  {name} step {i + 1}: loss {r.loss:.4f} {r.seconds:.2f} s"
                  f"{' (warm-up)' if i < row.warmup else ''}", flush=True)
        engine.synchronize()
    timed = results[row.warmup:] or results
    seconds = sum(r.seconds for r in timed) / len(timed)
    tokens = timed[0].tokens
    best = engine.plan_result.best if engine.plan_result is not None else None
    flops = model_flops(_dims(row, a.tiny), seq, row.batch, docs=row.docs)
    out = {
        "row": name, "settings": dataclasses.asdict(row), "seq": seq, "global_batch": row.batch,
        "tokens_per_step": tokens, "seconds_per_step": seconds, "tokens_per_s": tokens / seconds,
        "model_tflops": flops / seconds / 1e12, "model_flops_per_step": flops,
        "steps_s": [r.seconds for r in results], "losses": [r.loss for r in results],
        "gpu_peak_reserved": torch.cuda.max_memory_reserved(device) if cuda else 0,
        "gpu_peak_allocated": torch.cuda.max_memory_allocated(device) if cuda else 0,
        "gpu_cap": cap, "host_peak": rss.peak, "build_s": build_s, "engine_s": engine_s,
        "mlp_chunk_tokens": engine.mlp_chunk, "head_chunk_tokens": engine.head_chunk,
        "segment_attention": all(d.shell.segment_attention for d in engine.devices),
        "plan": engine.plan.describe(), "plan_settings": engine.plan.as_dict(),
        "predicted_s": best.time.step_s if best is not None else None,
        "predicted_tokens_per_s": best.time.tokens_per_s if best is not None else None,
        "gpu_need": best.gpu_need if best is not None else None,
        "host_need": best.host_need if best is not None else None,
        "memory_report": engine.memory_report().as_dict(),
        "offload_dir": a.offload_dir if row.offload else None, "hardware": a.hardware,
        "torch": torch.__version__, "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
    }
    engine.close()
    return out


# --------------------------------------------------------------------------- the driver


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows, run in this order "
                    f"(default: all, {', '.join(ROWS)})")
    ap.add_argument("--commit", default=None, help="the commit under test (default: git rev-parse)")
    ap.add_argument("--out", default=None, help="directory for the raw JSON of each row "
                    "(default: bench/results/long_context/<commit>)")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap and planning budget")
    ap.add_argument("--cpu-gib", type=float, default=None,
                    help="host memory to plan with (default: this machine's available RAM)")
    ap.add_argument("--hardware", default="h200-pcie5", help="the planner's hardware preset or file")
    ap.add_argument("--offload-dir", default="/tmp/tinypipe-long-context-ssd",
                    help="the SSD rows' offload directory (its rates are measured before they plan)")
    ap.add_argument("--budget-s", type=float, default=530.0,
                    help="wall seconds for everything: rows whose estimate does not fit what is left are skipped")
    ap.add_argument("--attention-tile-tokens", type=int, default=None,
                    help="Config.attention_tile_tokens for plans and runs (default: the engine's; 0: whole segments)")
    ap.add_argument("--plan-only", action="store_true", help="print the planner's table; run nothing")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (the smoke test)")
    ap.add_argument("--in-process", action="store_true", help="run the rows in this process (tests)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # child: NAME:SEQ:OUTFILE
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"unknown rows {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    a.names = names
    if a.cpu_gib is None:
        a.cpu_gib = _available_gib()
    return a


def _available_gib() -> float:
    import psutil

    return psutil.virtual_memory().available / GiB


def _commit(given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def estimate_s(row: Row, plan: dict[str, Any], tiny: bool) -> float:
    """Seconds the row is expected to take: overhead plus the planner's step time per step."""
    if tiny:
        return 5.0
    return row.overhead_s + (row.warmup + row.steps) * plan["step_s"] * 1.3


def _run_child(name: str, seq: int, out: Path, timeout: float, a: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, os.path.abspath(__file__), "--child", f"{name}:{seq}:{out}",
            "--cap-gib", str(a.cap_gib), "--cpu-gib", str(a.cpu_gib), "--hardware", a.hardware,
            "--offload-dir", a.offload_dir,
            *(["--tiny"] if a.tiny else []),
            *([] if a.attention_tile_tokens is None else ["--attention-tile-tokens", str(a.attention_tile_tokens)])]
    try:
        proc = subprocess.run(argv, timeout=max(1.0, timeout), capture_output=True, text=True)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-2000:] if isinstance(exc.stdout, bytes) else (exc.stdout or "")[-2000:]
        return {"row": name, "seq": seq, "error": f"timed out after {timeout:.0f} s", "log_tail": str(tail)}
    print(proc.stdout, end="", flush=True)
    if proc.returncode != 0 or not out.exists():
        return {"row": name, "seq": seq, "error": f"exit {proc.returncode}",
                "log_tail": (proc.stdout + proc.stderr)[-3000:]}
    return json.loads(out.read_text())


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GiB:.1f}"


def table(records: dict[str, dict[str, Any]], commit: str) -> str:
    lines = [f"long context at {commit} (GPU cap, global batch as listed; model TFLOPS: Megatron, causal)",
             f"{'row':<16} {'seq':>7} {'B':>2} {'tok/s':>8} {'TFLOPS':>7} {'GPU GiB':>8} {'host GiB':>8} "
             f"{'chunk':>6} {'tile':>6} {'pred tok/s':>10} {'pred GPU':>8} {'pred host':>9}  note"]
    for name, r in records.items():
        p = r.get("planned", {})
        tile = f"{p.get('attention_tile_tokens', '-')!s:>6}"
        pred = (f"{p['tokens_per_s']:>10,.0f} {_gib(p['gpu_need']):>8} {_gib(p['host_need']):>9}"
                if p.get("fits") else f"{'-':>10} {'-':>8} {'-':>9}")
        if "tokens_per_s" in r:
            lines.append(f"{name:<16} {r['seq']:>7} {r['global_batch']:>2} {r['tokens_per_s']:>8,.0f} "
                         f"{r['model_tflops']:>7.1f} {_gib(r['gpu_peak_reserved']):>8} {_gib(r['host_peak']):>8} "
                         f"{r['mlp_chunk_tokens']:>6} {tile} {pred}  {r['plan']}")
        else:
            note = r.get("skipped") or r.get("error") or ""
            lines.append(f"{name:<16} {r.get('seq', 0):>7} {ROWS[name].batch:>2} {'-':>8} {'-':>7} {'-':>8} "
                         f"{'-':>8} {p.get('mlp_chunk_tokens', '-')!s:>6} {tile} {pred}  {note}")
    ref = records.get("8b-full-2k", {}).get("model_tflops")
    for name in ("8b-full-128k", "8b-full-128k-ssd", "8b-full-longest"):
        got = records.get(name, {}).get("model_tflops")
        if ref and got:
            lines.append(f"{name}: {got / ref:.2f}x the 2K run's model TFLOPS (goal >= 0.8)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.child:  # one row, in a process of its own
        name, seq, path = a.child.split(":", 2)
        rec = run_row(name, ROWS[name], int(seq), a)
        Path(path).write_text(json.dumps(rec, indent=1, default=str))
        return 0
    start = time.monotonic()
    commit = _commit(a.commit)
    out_dir = Path(a.out) if a.out else ROOT / "bench" / "results" / "long_context" / commit
    out_dir.mkdir(parents=True, exist_ok=True)
    if not (a.plan_only or a.tiny) and any(ROWS[n].offload for n in a.names):
        a.hardware = ssd_hardware(a, out_dir)
    planned: dict[str, tuple[int, dict[str, Any]]] = {}
    for name in a.names:
        row = ROWS[name]
        if row.seq == 0:
            planned[name] = longest(row, a)
        else:
            seq = row_seq(row, a.tiny)
            planned[name] = (seq, plan_row(row, seq, a))
        seq, p = planned[name]
        print(f"plan {name}: {seq} tokens x {row.batch}: "
              + (f"{p['plan']}, {p['step_s']:.1f} s/step, GPU {_gib(p['gpu_need'])} GiB, host "
                 f"{_gib(p['host_need'])} GiB, MLP chunk {p['mlp_chunk_tokens']}" if p["fits"] else p["reason"]),
              flush=True)
    records: dict[str, dict[str, Any]] = {}
    for name in a.names:
        row = ROWS[name]
        seq, p = planned[name]
        rec: dict[str, Any]
        left = a.budget_s - (time.monotonic() - start)
        if not p["fits"]:
            rec = {"row": name, "seq": seq, "skipped": f"planner: {p['reason']}"}
        elif a.plan_only:
            rec = {"row": name, "seq": seq, "skipped": "--plan-only"}
        elif estimate_s(row, p, a.tiny) > left:
            rec = {"row": name, "seq": seq, "skipped": f"time budget: ~{estimate_s(row, p, a.tiny):.0f} s "
                   f"estimated, {left:.0f} s left"}
        elif a.in_process:
            rec = run_row(name, row, seq, a)
        else:
            rec = _run_child(name, seq, out_dir / f".{name}.child.json", left, a)
        rec.update(planned=p, commit=commit)
        records[name] = rec
        (out_dir / f"{name}.json").write_text(json.dumps(rec, indent=1, default=str))
        print(f"{name}: " + (f"{rec['tokens_per_s']:,.0f} tok/s, {rec['model_tflops']:.1f} TFLOPS"
                             if "tokens_per_s" in rec else rec.get("skipped") or rec.get("error", "")), flush=True)
    print(table(records, commit), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
