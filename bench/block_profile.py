#!/usr/bin/env python3
"""Where a decoder block's GPU time goes: eager vs torch.compile, and the top kernels.

    python bench/block_profile.py W1 --micro-batch 4            # on the GPU machine
    python bench/block_profile.py tiny --device cpu --micro-batch 2   # smoke test

Times the three things tinypipe runs per block and micro-batch: forward without autograd,
the recompute forward with autograd, and the backward; plus the block's matmuls alone (the
ceiling for an elementwise-fused block). Prints a table last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from benchkit.workloads import WORKLOADS  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn, dev: torch.device, reps: int) -> float:
    fn()
    _sync(dev)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(dev)
    return (time.perf_counter() - t) / reps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of the eager block")
    a = ap.parse_args(argv)
    w = WORKLOADS[a.workload]
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = transformers.LlamaConfig(**w.config)
    cfg._attn_implementation = "sdpa"
    cfg.num_hidden_layers = 2
    model = transformers.LlamaForCausalLM(cfg).to(dev, dtype)
    blocks = list(model.model.layers)
    B, S, H = a.micro_batch, w.seq, cfg.hidden_size
    x = torch.randn(B, S, H, device=dev, dtype=dtype)
    pos = torch.arange(S, device=dev).unsqueeze(0)
    rope = model.model.rotary_emb(x, pos)
    gout = torch.randn_like(x)
    params = [p for p in blocks[0].parameters()]
    layer_params = sum(p.numel() for p in params)

    def fwd(block):
        with torch.no_grad():
            out = block(x, position_embeddings=rope, position_ids=pos, attention_mask=None)
        return out

    def fwd_bwd(block):
        xi = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = block(xi, position_embeddings=rope, position_ids=pos, attention_mask=None)
            out = out[0] if isinstance(out, (tuple, list)) else out
            torch.autograd.grad(out, [xi] + list(block.parameters()), gout)

    # matmuls alone: the block's 7 projections, forward and the two backward GEMMs
    lin = [m for m in blocks[0].modules() if isinstance(m, torch.nn.Linear)]
    xs = {m: torch.randn(B * S, m.in_features, device=dev, dtype=dtype) for m in lin}
    gs = {m: torch.randn(B * S, m.out_features, device=dev, dtype=dtype) for m in lin}

    def mm_fwd():
        for m in lin:
            torch.mm(xs[m], m.weight.t())

    def mm_bwd():
        for m in lin:
            torch.mm(gs[m], m.weight)
            torch.mm(gs[m].t(), xs[m])

    rows = []
    tokens = B * S
    flops_fwd = 2 * layer_params * tokens + 2 * S * S * H * B  # causal attention: half of 4*S^2*H
    t_mm_f = _time(mm_fwd, dev, a.reps)
    t_mm_b = _time(mm_bwd, dev, a.reps)
    rows.append(("matmuls only", t_mm_f, t_mm_b + t_mm_f))
    t_f = _time(lambda: fwd(blocks[0]), dev, a.reps)
    t_fb = _time(lambda: fwd_bwd(blocks[0]), dev, a.reps)
    rows.append(("eager", t_f, t_fb))
    if a.profile and dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fwd(blocks[0])
            fwd_bwd(blocks[0])
            _sync(dev)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    if not a.no_compile:
        from tinypipe.models.compiled import CompiledBlock

        compiled = []
        for block in blocks[:2]:  # the second block (another layer_idx) should reuse the first's graphs
            t0 = time.perf_counter()
            c = CompiledBlock(block, "inductor")
            fwd(c)
            fwd_bwd(c)
            _sync(dev)
            compiled.append((c, time.perf_counter() - t0))
        (c0, first), (_, second) = compiled
        print(f"compile: first block {first:.1f} s, second block (another layer_idx) {second:.1f} s")
        t_cf = _time(lambda: fwd(c0), dev, a.reps)
        t_cfb = _time(lambda: fwd_bwd(c0), dev, a.reps)
        rows.append(("torch.compile", t_cf, t_cfb))
    print(f"\n=== block of {a.workload}: {layer_params / 1e6:.1f} M params, micro-batch {B} x {S} tokens, {dtype} ===")
    print("| variant | fwd ms | recompute+bwd ms | fwd TFLOP/s | rec+bwd TFLOP/s |")
    for name, f, fb in rows:
        print(f"| {name} | {f * 1e3:.2f} | {fb * 1e3:.2f} | {flops_fwd / f / 1e12:.0f} | {3 * flops_fwd / fb / 1e12:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
