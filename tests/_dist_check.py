"""Comparing data-parallel runs with one process training the same global batches."""

from __future__ import annotations

import torch

from _dist_worker import EPS, LR, WD, batches, make
from reference import compare, train_reference


def trainable_names(spec: dict) -> set[str]:
    model = make(spec)
    inner = model.base_model.model if spec.get("lora") else model
    # state_dict keeps tied aliases (lm_head.weight of a tied embedding), named_parameters does not
    return {n for n, p in inner.state_dict(keep_vars=True).items() if p.requires_grad}


def errors(spec: dict, results: list[dict]) -> dict[str, float]:
    """Worst relative errors of the replicas against the single-process reference: per-step loss
    and gradient norm, per-tensor weights, and the whole update vector (trainable tensors)."""
    model = make(spec)
    inner = model.base_model.model if spec.get("lora") else model
    init = {k: v.clone() for k, v in inner.state_dict().items()}
    clip = spec.get("cfg", {}).get("max_grad_norm")
    used = [b for i, b in enumerate(batches(spec)) if i not in spec.get("skip_steps", ())]
    ref = train_reference(inner, used, lr=LR, eps=EPS, weight_decay=WD, max_grad_norm=clip)
    names = trainable_names(spec)
    out = {"loss": 0.0, "norm": 0.0, "weights": 0.0, "update": 0.0, "clip_mismatch": 0.0}
    for r in results:
        for a, b in zip(r["losses"], ref.losses):
            out["loss"] = max(out["loss"], abs(a - b) / abs(b))
        for a, b in zip(r["norms"], ref.grad_norms):
            out["norm"] = max(out["norm"], abs(a - b) / b)
        if clip is not None:
            want = [n + 1e-6 > clip for n in ref.grad_norms]
            out["clip_mismatch"] += sum(x != y for x, y in zip(r["clipped"], want))
        state = {k: v for k, v in r["state"].items() if k in names}
        ref_sd = {k: v for k, v in ref.model.state_dict().items() if k in names}
        worst, update = compare(state, _Sd(ref_sd), {k: init[k] for k in names})
        out["weights"] = max(out["weights"], worst)
        out["update"] = max(out["update"], update)
        for k, v in r["state"].items():  # frozen weights never move
            if k not in names:
                assert torch.equal(v, init[k]), k
    return out


def assert_exact(spec: dict, results: list[dict]) -> dict[str, float]:
    """The equivalence tests' tolerances (tests/test_equivalence.py), and every rank's weights
    bit-identical to rank 0's."""
    e = errors(spec, results)
    assert e["loss"] <= 1e-5 and e["norm"] <= 1e-5, e
    assert e["clip_mismatch"] == 0, e
    assert e["weights"] <= 1e-5 and e["update"] <= 1e-4, e
    for r in results[1:]:
        for k, v in r["state"].items():
            assert torch.equal(v, results[0]["state"][k]), f"ranks differ on {k}"
    return e


class _Sd:
    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        self._sd = sd

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._sd
