"""One attention layer at 64K tokens of the 8B heads (bf16, causal, GQA 32/8): forward + backward
time of SDPA per backend (default choice, flash, cuDNN, efficient) against the tiles on flash and on
cuDNN (8K, 16K, 32K tiles). Prints a table: the attention rate a long-context time model needs.

    PYTHONPATH=. python3 bench/archive/tile_speed_probe.py"""
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tinypipe.models.tiled_attention import tiled_causal_attention

L, H, KV, D = 65536, 32, 8, 128
dev = "cuda"
q = torch.randn(1, L, H, D, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
k = torch.randn(1, L, KV, D, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
v = torch.randn(1, L, KV, D, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
g = torch.randn(1, L, H, D, device=dev, dtype=torch.bfloat16)


def timed(fn, reps=2):
    for _ in range(1):
        out = fn(); torch.autograd.grad(out, (q, k, v), g)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(reps):
        out = fn(); torch.autograd.grad(out, (q, k, v), g)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    fwd = (t1 - t0) / reps
    return fwd, (t2 - t1) / reps - fwd


rows = []
for name, backends in (("sdpa default", None), ("flash", [SDPBackend.FLASH_ATTENTION]),
                       ("cudnn", [SDPBackend.CUDNN_ATTENTION]), ("efficient", [SDPBackend.EFFICIENT_ATTENTION])):
    def run():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    try:
        if backends is None:
            rows.append((name, *timed(run)))
        else:
            with sdpa_kernel(backends):
                rows.append((name, *timed(run)))
    except RuntimeError as e:
        rows.append((name, float("nan"), float("nan")))
        print(name, "failed:", str(e).splitlines()[0][:120])
for kernel in ("flash", "cudnn"):
    for tile in (8192, 16384, 32768):
        try:
            rows.append((f"{kernel} tiles {tile}",
                         *timed(lambda: tiled_causal_attention(q, k, v, None, tile, kernel))))
        except RuntimeError as e:
            rows.append((f"{kernel} tiles {tile}", float("nan"), float("nan")))
            print(kernel, tile, "failed:", str(e).splitlines()[0][:120])
flops = 4 * L * L / 2 * D * H
print(torch.__version__, torch.cuda.get_device_name())
print(f"{'kernel':20} {'fwd ms':>8} {'bwd ms':>8} {'fwd TFLOPS':>10} {'bwd TFLOPS':>10}")
for name, f, b in rows:  # backward FLOPs: 2.5x the forward's (FlashAttention-2's count)
    print(f"{name:20} {f * 1e3:8.1f} {b * 1e3:8.1f} {flops / f / 1e12:10.1f} {2.5 * flops / b / 1e12:10.1f}")
