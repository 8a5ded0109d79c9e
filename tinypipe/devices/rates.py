"""Measured machine rates: pinned host<->device bandwidth, bf16 matmul rate, the CPU's fused AdamW
and memcpy rates. ``tinypipe profile`` (planner/profile.py) records them in a hardware file; the
benchmarks in ``bench/`` take them as the inputs of the physical bound (bench/benchkit/analysis.py)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.optim.adamw as _adamw


@dataclass
class MachineRates:
    h2d_gbs: float
    d2h_gbs: float
    both_gbs: float
    matmul_tflops: float
    adamw_gparams_s: float
    device_name: str

    def as_dict(self) -> dict:
        return asdict(self)


def cpu_adamw_rate(n: int = 50_000_000) -> float:
    """torch's fused CPU AdamW on ``n`` parameters, G params/s (best of 3 steps): also taken after a
    benchmark's timed steps, because on a shared host it moves within minutes (docs/measured.md)."""
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    steps = [torch.tensor(0.0)]
    best = float("inf")
    for i in range(3):
        t = time.perf_counter()
        _adamw.adamw([p], [g], [m], [v], [], steps, fused=True, amsgrad=False, beta1=0.9, beta2=0.999,
                     lr=1e-5, weight_decay=0.0, eps=1e-8, maximize=False)
        best = min(best, time.perf_counter() - t)
    return n / best / 1e9


def cpu_copy_gbs(nbytes: int = 256 << 20) -> float:
    """Host memcpy bandwidth (GB/s), best of 3: what a CPU "device" pays to upload a layer."""
    a = torch.empty(nbytes, dtype=torch.uint8)
    a.fill_(1)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def measure(device: str = "cuda:0", transfer_bytes: int = 1 << 30, adamw_params: int = 50_000_000,
            matmul_n: int = 8192) -> MachineRates:
    """Pinned H2D / D2H / bidirectional bandwidth (``transfer_bytes``, default 1 GiB), bf16
    ``matmul_n``^3 matmul, CPU fused AdamW (``adamw_params``). On a CPU device the link and matmul
    rates are 0."""
    adamw = cpu_adamw_rate(adamw_params)
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return MachineRates(0.0, 0.0, 0.0, 0.0, adamw, "cpu")
    dev = torch.device(device)
    n = int(transfer_bytes)
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    host2 = torch.empty(n, dtype=torch.uint8).pin_memory()
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    d2 = torch.empty(n, dtype=torch.uint8, device=dev)
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def timed(fn, reps: int = 3) -> float:
        fn()
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(dev)
        return (time.perf_counter() - t) / reps

    h2d = n / timed(lambda: d.copy_(host, non_blocking=True)) / 1e9
    d2h = n / timed(lambda: host.copy_(d, non_blocking=True)) / 1e9

    def both() -> None:
        with torch.cuda.stream(s1):
            d.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(d2, non_blocking=True)

    bidir = 2 * n / timed(both) / 1e9
    k = int(matmul_n)
    a = torch.randn(k, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, k, device=dev, dtype=torch.bfloat16)
    mm = timed(lambda: a @ b, reps=10)
    tflops = 2 * k**3 / mm / 1e12
    del host, host2, d, d2, a, b
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    release = getattr(torch._C, "_host_emptyCache", None)  # pinned blocks stay cached (and in RSS) otherwise
    if release is not None:
        release()
    return MachineRates(h2d, d2h, bidir, tflops, adamw, torch.cuda.get_device_name(dev))
