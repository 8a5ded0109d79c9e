"""Why test_assist_runtime's OPT case failed on one CPU: its reference passed 1.8e-8 from a ReLU
kink at step 2, so one ulp of rounding picked the branch.

Prints (1) the engine's grad norms against the whole-batch reference for micro-batches 5 / 2 / 1,
(2) the reference's own norms after +-1 ulp of noise on its initial weights, (3) per step the least
|ReLU input| along the reference for five sets of batch seeds. Run: python bench/archive/relu_kink.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import tinypipe  # noqa: E402
from model_zoo import make_batch, make_model  # noqa: E402
from reference import ReferenceTrainer, randomize_biases, train_reference  # noqa: E402

LR, EPS, WD, CLIP = 1e-3, 1e-6, 0.1, 1e-3  # test_assist_runtime's


def fresh() -> torch.nn.Module:
    model = make_model("opt", layers=4)
    randomize_biases(model)
    return model


def rel(norms: list[float], ref: list[float]) -> str:
    return " ".join(f"{(a - b) / b:+.1e}" for a, b in zip(norms, ref))


def main() -> None:
    batches = [make_batch(5, 12, seed=i) for i in range(5)]
    ref = train_reference(fresh(), batches, lr=LR, eps=EPS, weight_decay=WD, max_grad_norm=CLIP)
    print("(1) engine grad norm vs reference, relative, steps 0-4 (seeds 0-4)")
    for mb in (5, 2, 1):
        cfg = dict(devices=["cpu"], pack_size=2, micro_batch_size=mb, resident_packs=1, max_grad_norm=CLIP)
        engine = tinypipe.Engine(fresh(), tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD,
                                                          head_chunk_tokens=7, **cfg))
        print(f"  micro-batch {mb}: {rel([engine.step(b).grad_norm for b in batches], ref.grad_norms)}")
        engine.close()
    print("(2) reference with +-1 ulp on its initial weights vs unperturbed")
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        model = fresh()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.abs() * torch.randn(p.shape, generator=g).sign() * 2**-23)
        run = train_reference(model, batches, lr=LR, eps=EPS, weight_decay=WD, max_grad_norm=CLIP)
        print(f"  noise seed {seed}: {rel(run.grad_norms, ref.grad_norms)}")
    print("(3) least |ReLU input| per step along the reference")
    for first in (0, 5, 10, 15, 20):
        trainer = ReferenceTrainer(fresh(), lr=LR, eps=EPS, weight_decay=WD, max_grad_norm=CLIP)
        margins = []
        for s in range(first, first + 5):
            trainer.step(make_batch(5, 12, seed=s))
            margins.append(trainer.kink_margin)
        print(f"  seeds {first}-{first + 4}: " + " ".join(f"{m:.1e}" for m in margins))


if __name__ == "__main__":
    main()
