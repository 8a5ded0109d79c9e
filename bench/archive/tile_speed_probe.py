"""One attention layer at 64K tokens of the 8B heads (bf16, causal, GQA 32/8): forward + backward
time of SDPA per backend (default choice, flash, cuDNN, efficient) against the tiles. Prints a table."""
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
for tile in (8192, 16384):
    rows.append((f"tiles {tile}", *timed(lambda: tiled_causal_attention(q, k, v, None, tile))))
flops = 4 * L * L / 2 * D * H
print(torch.__version__, torch.cuda.get_device_name())
print(f"{'kernel':14} {'fwd ms':>8} {'bwd ms':>8} {'fwd TFLOPS':>10}")
for name, f, b in rows:
    print(f"{name:14} {f * 1e3:8.1f} {b * 1e3:8.1f} {flops / f / 1e12:10.1f}")
