#!/usr/bin/env python3
"""The two facts the step-by-step int8 test (tests/test_qlora.py) rests on, on this CPU:

1. which fp32 GEMM row counts give the same rows as one 60-row GEMM (the test's 5 x 12 tokens):
   where they differ, a whole-batch reference and the engine's micro-batches round differently;
2. with the reference started from the engine's adapters in the engine's micro-batches, every
   input of every int8 layer equals one the engine fed it, bit for bit (all steps).

    python bench/archive/int8_shapes.py

CPU only, ~15 s. Prints the mismatching element counts per row count, then the bit-equality
counts per configuration.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import bitsandbytes as bnb  # noqa: E402

import tinypipe  # noqa: E402
from model_zoo import make_batch  # noqa: E402
from reference import ReferenceTrainer  # noqa: E402
from test_qlora import BATCH, CONFIGS, EPS, INT8, LR, SEQ, STEPS, WD, qlora_model  # noqa: E402


def gemm_rows() -> None:
    g = torch.Generator().manual_seed(0)
    rows = (1, 2, 3, 12, 24, 36, 48)
    print(f"elements of an m-row GEMM that differ from the same rows of a 60-row one, m = {rows}")
    for k, n in ((32, 32), (64, 64), (64, 176), (32, 97)):
        a, w = torch.randn(60, k, generator=g), torch.randn(n, k, generator=g)
        full = torch.nn.functional.linear(a, w)
        diff = [int((torch.nn.functional.linear(a[:m], w) != full[:m]).sum()) for m in rows]
        print(f"  K={k:<3} N={n:<3}", diff)


def capture(model: torch.nn.Module, store: list[torch.Tensor]) -> None:
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear8bitLt):
            m.register_forward_hook(lambda mod, inp, out: store.append(inp[0].detach().clone()))


def engine_inputs(name: str) -> None:
    cfg = dict(CONFIGS[name])
    pm = qlora_model("llama", INT8)
    inner = pm.base_model.model
    ref = ReferenceTrainer(inner, lr=LR, eps=EPS, weight_decay=WD,
                           max_grad_norm=cfg.get("max_grad_norm"), micro_batch_size=cfg["micro_batch_size"])
    params = dict(ref.model.named_parameters())
    seen_ref: list[torch.Tensor] = []
    seen_engine: list[torch.Tensor] = []
    capture(ref.model, seen_ref)
    capture(inner, seen_engine)  # the engine runs the model's own modules
    config = tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD, head_chunk_tokens=7, **cfg)
    with tinypipe.Engine(pm, config) as e:
        for i in range(STEPS):
            batch = make_batch(BATCH, SEQ, seed=i, pad=i == 1)
            with torch.no_grad():
                for k, v in e.state_dict().items():
                    if ".lora_" in k:
                        params[k].copy_(v)
            ref.step(batch)
            e.step(batch)
    equal = sum(any(x.shape == r.shape and torch.equal(x, r) for x in seen_engine) for r in seen_ref)
    print(f"  {name}: {equal} of {len(seen_ref)} reference int8-layer inputs equal an engine input "
          "bit for bit")


def main() -> None:
    torch.set_num_threads(1)
    gemm_rows()
    print("step by step from the engine's adapters, in its micro-batches:")
    for name in ("1dev_packs2_mb2_window2_clip", "2dev_packs2_host_stash"):
        engine_inputs(name)


if __name__ == "__main__":
    main()
