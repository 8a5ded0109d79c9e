#!/usr/bin/env python3
"""How far one float-rounding difference moves an int8 (LLM.int8()) QLoRA run: the reference of
tests/test_qlora.py (PEFT + bitsandbytes + torch AdamW, 3 steps) trained again with +-1 ulp of
noise on every decoder layer's output, per seed; fp4 (whose activations stay fp32) beside it.

    python bench/archive/int8_sensitivity.py [--seeds 12]

int8 rounds each activation row to 127 levels, so a 1-ulp change upstream can flip a code; CPUs
differ in which GEMM shapes round alike, which is why the int8 test compares step by step from
the engine's adapters. CPU only, ~20 s. Prints one row per scheme and seed.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from model_zoo import make_batch  # noqa: E402
from reference import train_reference  # noqa: E402
from test_qlora import BATCH, EPS, FP4, INT8, LR, SEQ, STEPS, WD, qlora_model  # noqa: E402


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of ``model`` whose decoder layers add -1, 0 or +1 ulp (fp32) to each output element."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)

    def hook(mod, inp, out):
        h = out[0] if isinstance(out, tuple) else out
        h = h + torch.randint(-1, 2, h.shape, generator=g).to(h.dtype) * h.abs() * 2.0**-23
        return (h, *out[1:]) if isinstance(out, tuple) else h

    for layer in m.model.layers:
        layer.register_forward_hook(hook)
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=12)
    a = ap.parse_args()
    torch.set_num_threads(1)
    batches = [make_batch(BATCH, SEQ, seed=i, pad=i == 1) for i in range(STEPS)]
    print(f"{'scheme':<7} {'seed':>4} {'grad norm':>10} {'loss':>9} {'adapter':>9} {'update':>9}   "
          "(largest relative change over the steps; adapter: worst tensor after the last step)")
    for spec in (INT8, FP4):
        inner = qlora_model("llama", spec).base_model.model
        init = {k: v.clone() for k, v in inner.state_dict().items() if ".lora_" in k}
        base = train_reference(inner, batches, lr=LR, eps=EPS, weight_decay=WD)
        bsd = base.model.state_dict()
        for seed in range(a.seeds):
            run = train_reference(perturbed(inner, seed), batches, lr=LR, eps=EPS, weight_decay=WD)
            rsd = run.model.state_dict()
            worst = max(float((rsd[k] - bsd[k]).norm() / bsd[k].norm()) for k in init)
            diff = sum(float(((rsd[k] - bsd[k]) ** 2).sum()) for k in init) ** 0.5
            delta = sum(float(((bsd[k] - init[k]) ** 2).sum()) for k in init) ** 0.5
            norm = max(abs(x - y) / y for x, y in zip(run.grad_norms, base.grad_norms))
            loss = max(abs(x - y) / y for x, y in zip(run.losses, base.losses))
            print(f"{spec.scheme:<7} {seed:>4} {norm:>10.1e} {loss:>9.1e} {worst:>9.1e} {diff / delta:>9.1e}")


if __name__ == "__main__":
    main()
