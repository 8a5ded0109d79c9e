#!/usr/bin/env python3
"""The head task alone: final norm + output embedding + token cross-entropy, forward and backward,
chunked over tokens as the engine runs it -- the code before the fused loss against the code now.

    python bench/head_bench.py --json head.json        # on the GPU machine (< 90 s on an H200)
    python bench/head_bench.py --small                  # CPU smoke test, tiny shapes

Paths, per workload (bf16; W1 = Llama-3.2-3B head: 32768 tokens, hidden 3072, vocab 128256;
W3 = Llama-2-7B head: hidden 4096, vocab 32000):

* ``old``: the head before the fused loss (a copy of it below): 697-token chunks at W1 (6 B/logit
  in a 512 MiB budget), the loss and logit gradient in eager kernels over a whole fp32 copy;
* ``eager``: today's eager path (CPU, or blocks not compiled): larger chunks
  (``chunk_tokens_for``), fp32 work in row blocks -- the same numbers as ``old`` per chunk;
* ``fused``: today's CUDA path: the loss and logit gradient compiled by Inductor
  (``HeadLoss``), written over the bf16 logits; on CPU Inductor's C++ backend (if a compiler
  is installed);
* ``eager@old``, ``fused@old``: the same at the old chunk, which separates the elementwise
  part's rounding from the chunking's (partial sums of the weight and norm gradients per chunk);
* ``matmuls``: the three matmuls alone at today's chunk (the ceiling for the elementwise part).

Times are CUDA events (CPU: wall clock) over every chunk of the tokens, the median of
``--reps`` runs after a warm-up run (which compiles). ``peak MiB``: allocator peak above what
was allocated before the run (CUDA only, the accumulators preallocated as in the engine), next to
``plan MiB``: the planner's per-chunk head terms (logits and fp32 row block, chunk x hidden x 4).
Differences are against ``old``: loss |a-b|/|b|; d hidden, d norm weight and d weight (the fp32
accumulator) max |a-b| and max |a-b| / max |b|. The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from tinypipe.models.head import _accumulate_matmul, chunk_tokens_for, fused_head_chunk  # noqa: E402
from tinypipe.models.head_loss import IGNORE, HeadLoss, logit_bytes  # noqa: E402

BUDGET = 512 * 1024**2  # the engine's head chunk budget (chunk_tokens_for's default)


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int
    hidden: int
    vocab: int
    budget: int  # chunk budget in bytes (small shapes: scaled so chunks per run stay alike)


FULL = [Shape("W1", 32768, 3072, 128256, BUDGET), Shape("W3", 32768, 4096, 32000, BUDGET)]
# tiny shapes for CPU: ~10 old chunks per run, as at W1 (47)
SMALL = [Shape("W1-small", 1024, 64, 2000, 2000 * 6 * 100), Shape("W3-small", 1024, 96, 500, 500 * 6 * 100)]


class RMSNorm(nn.Module):
    """Llama's final norm (transformers' LlamaRMSNorm, with a weight to train)."""

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(hidden) * 0.5 + 0.75)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def old_head_chunk(post: list[nn.Module], lm_head: nn.Module, x: torch.Tensor, labels: torch.Tensor,
                   denom: float, post_params: list[torch.Tensor], weight_acc: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    """``fused_head_chunk`` as it was before the fused loss (commit f9da163), weight gradient
    accumulated into ``weight_acc``."""
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        h = x
        for m in post:
            h = m(h)
    weight = lm_head.weight
    with torch.no_grad():
        logits = h.detach() @ weight.t()
        lf = logits.float()
        del logits
        valid = labels != IGNORE
        safe = torch.where(valid, labels, torch.zeros_like(labels))
        lse = torch.logsumexp(lf, dim=-1)
        picked = lf.gather(1, safe[:, None]).squeeze(1)
        loss = ((lse - picked) * valid).sum() / denom
        lf.sub_(lse[:, None]).exp_()
        lf.scatter_add_(1, safe[:, None], -torch.ones_like(lf[:, :1]))
        lf.mul_((valid.to(lf.dtype) / denom)[:, None])
        g = lf.to(h.dtype)
        del lf
        grad_h = g @ weight
        _accumulate_matmul(weight_acc, g.t(), h.detach())
        del g
    grads = torch.autograd.grad(h, [x] + post_params, grad_h, allow_unused=True)
    return loss, grads[0], list(grads[1:])


@dataclass
class Result:
    loss: torch.Tensor
    grad_x: torch.Tensor
    grad_norm: torch.Tensor
    grad_w: torch.Tensor


class Head:
    """One workload's head on ``dev``: norm, output embedding, hidden states and labels."""

    def __init__(self, shape: Shape, dev: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        gd = torch.Generator(device=dev).manual_seed(seed)  # the large tensors: drawn on the device
        self.shape, self.dev = shape, dev
        self.norm = RMSNorm(shape.hidden).to(dev, dtype)
        self.lm_head = nn.Linear(shape.hidden, shape.vocab, bias=False, device="meta")
        weight = torch.randn(shape.vocab, shape.hidden, generator=gd, device=dev) * 0.02
        self.lm_head.weight = nn.Parameter(weight.to(dtype))
        self.x = torch.randn(shape.tokens, shape.hidden, generator=gd, device=dev).to(dtype)
        labels = torch.randint(0, shape.vocab, (shape.tokens,), generator=g)
        labels[torch.rand(shape.tokens, generator=g) < 0.05] = IGNORE  # some positions ignored
        self.labels = labels.to(dev)
        self.host_labels = labels
        self.denom = float((labels != IGNORE).sum())
        self.post_params = [self.norm.weight]

    def zeros(self) -> Result:
        """Zeroed accumulators (the engine's: they exist before the head task runs)."""
        H = self.shape.hidden
        return Result(torch.zeros((), dtype=torch.float64, device=self.dev), torch.zeros_like(self.x),
                      torch.zeros(H, dtype=torch.float32, device=self.dev),
                      torch.zeros(self.shape.vocab, H, dtype=torch.float32, device=self.dev))

    def run(self, out: Result, chunk: int, kind: str, head_loss: HeadLoss | None = None) -> Result:
        """The head over every token in ``chunk``-token chunks, as the engine's head task runs it,
        accumulated into ``out``."""
        T = self.x.shape[0]
        for c0 in range(0, T, chunk):
            c1 = min(T, c0 + chunk)
            if not bool((self.host_labels[c0:c1] != IGNORE).any()):
                continue
            x, y = self.x[c0:c1], self.labels[c0:c1]
            if kind == "old":
                loss, gx, (gn,) = old_head_chunk([self.norm], self.lm_head, x, y, self.denom,
                                                 self.post_params, out.grad_w)
            else:
                loss, gx, (gn,), _ = fused_head_chunk([self.norm], self.lm_head, x, y, self.denom,
                                                      self.post_params, out.grad_w, loss_grad=head_loss)
            out.grad_x[c0:c1] = gx
            out.grad_norm.add_(gn)
            out.loss += loss.double()
        return out

    def matmuls(self, chunk: int) -> None:
        """The three matmuls of every chunk, nothing else."""
        w = self.lm_head.weight.detach()
        acc = torch.zeros(self.shape.vocab, self.shape.hidden, dtype=torch.float32, device=self.dev)
        with torch.no_grad():
            for c0 in range(0, self.x.shape[0], chunk):
                h = self.x[c0 : c0 + chunk]
                logits = h @ w.t()
                logits @ w
                _accumulate_matmul(acc, logits.t(), h)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], object], dev: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs (CUDA events on CUDA)."""
    times = []
    for _ in range(reps):
        _sync(dev)
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def peak_extra(fn: Callable[[], object], dev: torch.device) -> int | None:
    """Allocator peak of one ``fn`` run above what was allocated before it (CUDA)."""
    if dev.type != "cuda":
        return None
    _sync(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    _sync(dev)
    return torch.cuda.max_memory_allocated(dev) - base


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.double() - b.double()).abs().max().item()
    return d, d / max(b.double().abs().max().item(), 1e-300)


def compare(res: Result, ref: Result) -> dict:
    loss_abs = abs(res.loss.item() - ref.loss.item())
    out = {"loss": res.loss.item(), "loss_abs": loss_abs, "loss_rel": loss_abs / abs(ref.loss.item())}
    for name, a, b in (("dx", res.grad_x, ref.grad_x), ("dnorm", res.grad_norm, ref.grad_norm),
                       ("dw", res.grad_w, ref.grad_w)):
        out[f"{name}_abs"], out[f"{name}_rel"] = _diff(a, b)
    return out


def bench_shape(shape: Shape, dev: torch.device, reps: int, fused_ok: bool) -> list[dict]:
    head = Head(shape, dev, torch.bfloat16)
    old_chunk = int(max(64, min(8192, shape.budget // (shape.vocab * 6))))
    new_chunk = chunk_tokens_for(shape.vocab, shape.budget)
    V, H = shape.vocab, shape.hidden
    # name, chunk, elementwise part (None: the old code); "@old": at the old chunk, which isolates
    # the elementwise part's rounding from the chunking's
    paths: list[tuple[str, int, HeadLoss | None]] = [("old", old_chunk, None),
                                                     ("eager@old", old_chunk, HeadLoss(None)),
                                                     ("eager", new_chunk, HeadLoss(None))]
    if fused_ok:
        fused = HeadLoss("inductor", cuda_only=False)
        paths += [("fused@old", old_chunk, fused), ("fused", new_chunk, fused)]
    scratch = head.zeros()  # timed runs accumulate here (the numbers compared come from the warm-up)
    rows: list[dict] = []
    ref: Result | None = None
    for name, chunk, head_loss in paths:
        kind = "old" if head_loss is None else "new"
        t0 = time.perf_counter()
        result = head.run(head.zeros(), chunk, kind, head_loss)  # warm-up (compiles the fused path)
        _sync(dev)
        warm = time.perf_counter() - t0
        seconds = timed(lambda: head.run(scratch, chunk, kind, head_loss), dev, reps)
        # the planner's per-chunk head terms: the logits (old: 8 B/logit) and chunk x H x 4
        bound = (chunk * V * 8 if head_loss is None else logit_bytes(chunk, V, 2)) + chunk * H * 4
        row = {"workload": shape.name, "path": name, "tokens": shape.tokens, "hidden": H, "vocab": V,
               "chunk": chunk, "seconds": seconds, "warmup_s": warm,
               "peak_extra_bytes": peak_extra(lambda: head.run(scratch, chunk, kind, head_loss), dev),
               "planner_bound_bytes": bound}
        if head_loss is not None and head_loss.backend is not None:
            row["compile_failed"] = head_loss.failed
        ref = ref or result
        row.update(compare(result, ref))
        rows.append(row)
        del result
    seconds = timed(lambda: head.matmuls(new_chunk), dev, reps)
    rows.append({"workload": shape.name, "path": "matmuls", "tokens": shape.tokens, "hidden": H, "vocab": V,
                 "chunk": new_chunk, "seconds": seconds})
    for r in rows:
        r["speedup_vs_old"] = rows[0]["seconds"] / r["seconds"]
    return rows


def _fmt(v: object, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    head = (f"{'workload':<9} {'path':<9} {'chunk':>6} {'ms':>9} {'x old':>6} {'peak MiB':>9} "
            f"{'plan MiB':>9} {'loss rel':>9} {'dx abs':>9} {'dx rel':>9} {'dnorm rel':>9} "
            f"{'dW abs':>9} {'dW rel':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        peak = r.get("peak_extra_bytes")
        bound = r.get("planner_bound_bytes")
        lines.append(
            f"{r['workload']:<9} {r['path']:<9} {r['chunk']:>6} {r['seconds'] * 1e3:>9.2f} "
            f"{r['speedup_vs_old']:>6.2f} {_fmt(peak and peak / 2**20, '9.1f'):>9} "
            f"{_fmt(bound and bound / 2**20, '9.1f'):>9} {_fmt(r.get('loss_rel'), '9.2e'):>9} "
            f"{_fmt(r.get('dx_abs'), '9.2e'):>9} {_fmt(r.get('dx_rel'), '9.2e'):>9} "
            f"{_fmt(r.get('dnorm_rel'), '9.2e'):>9} {_fmt(r.get('dw_abs'), '9.2e'):>9} "
            f"{_fmt(r.get('dw_rel'), '9.2e'):>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="default: cuda:0 if available, else cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke test)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-fused", action="store_true", help="skip the compiled path")
    ap.add_argument("--json", default=None, help="write the rows (and the setup) to this file")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU: intra-op threads (one: steadier times on a shared machine)")
    a = ap.parse_args(argv)
    dev = torch.device(a.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu":
        torch.set_num_threads(a.threads)
    shapes = SMALL if a.small else FULL
    t0 = time.perf_counter()
    rows = []
    for shape in shapes:
        rows += bench_shape(shape, dev, a.reps, fused_ok=not a.no_fused)
        print(f"{shape.name}: done at {time.perf_counter() - t0:.1f} s", flush=True)
    total = time.perf_counter() - t0
    if a.json:
        meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda"
                else platform.processor() or platform.machine(), "reps": a.reps, "small": a.small,
                "total_s": total}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"total {total:.1f} s on {dev}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
