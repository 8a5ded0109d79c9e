"""bf16 on CUDA (the default on GPUs) against plain PyTorch autocast training (skipped without a GPU).

The reference is what Hugging Face Trainer's ``bf16=True`` does: fp32 weights, ``torch.autocast``
in bf16, fp32 gradients, ``torch.optim.AdamW`` (HF's decay / no-decay groups) on the whole batch at
once. tinypipe computes with a bf16 copy of the fp32 master weights, in micro-batches, accumulating
fp32 gradients. The two differ by bf16 rounding only, so they agree to a stated tolerance -- and the
tolerance is checked to be tight enough: the same comparison against a reference that saw only half
of each batch (what a dropped micro-batch would give) must fail it by a wide margin.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from reference import hf_param_groups, randomize_biases

pytestmark = pytest.mark.gpu

LR, EPS, WD = 1e-3, 1e-6, 0.1
STEPS = 4
#: bf16 has 8 significant bits: per-step losses agree to this relative tolerance ...
LOSS_RTOL = 1e-2
#: ... and the whole update vector (weights after STEPS minus before) to this relative error.
UPDATE_RTOL = 0.1


def _autocast_reference(model: torch.nn.Module, batches: list[dict], rows: slice | None = None) -> tuple:
    ref = copy.deepcopy(model).cuda()
    # HF Trainer's groups: no decay on biases and norm weights (tinypipe's default too)
    opt = torch.optim.AdamW(hf_param_groups(ref, WD), lr=LR, eps=EPS, fused=True)
    losses = []
    for b in batches:
        ids = b["input_ids"][rows] if rows is not None else b["input_ids"]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = ref(input_ids=ids.cuda(), labels=ids.cuda())
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    return {k: v.float().cpu() for k, v in ref.state_dict().items()}, losses


def _update_error(state: dict, ref: dict, init: dict) -> float:
    diff = sum(float(((state[k].float() - ref[k]) ** 2).sum()) for k in ref) ** 0.5
    delta = sum(float(((ref[k] - init[k]) ** 2).sum()) for k in ref) ** 0.5
    return diff / delta


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cuda:0"]], ids=["1dev", "2x_same_gpu"])
def test_cuda_bf16_matches_autocast_training(family: str, devices: list[str]) -> None:
    model = make_model(family, layers=4)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [make_batch(8, 64, seed=i) for i in range(STEPS)]
    ref_state, ref_losses = _autocast_reference(model, batches)
    half_state, _ = _autocast_reference(model, batches, rows=slice(0, 4))
    cfg = tinypipe.Config(devices=devices, precision="bf16", pack_size=2, micro_batch_size=2,
                          stash="host", lr=LR, eps=EPS, weight_decay=WD)
    with tinypipe.Engine(model, cfg) as engine:
        losses = [engine.step(b).loss for b in batches]
        state = {k: v.float().cpu() for k, v in engine.state_dict().items()}
    for mine, theirs in zip(losses, ref_losses):
        assert abs(mine - theirs) <= LOSS_RTOL * abs(theirs), (losses, ref_losses)
    err = _update_error(state, ref_state, init)
    wrong = _update_error(half_state, ref_state, init)
    print(f"{family} {len(devices)} entries: update error {err:.4f} (tolerance {UPDATE_RTOL}); "
          f"half-batch reference {wrong:.4f}")
    assert err <= UPDATE_RTOL, err
    assert wrong >= 3 * UPDATE_RTOL, f"the tolerance cannot tell a dropped micro-batch: {wrong:.4f}"
