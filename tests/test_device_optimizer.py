"""Resident layers stepped on their device (``Config.device_optimizer``) train exactly like plain PyTorch.

The embedding's / head's fp32 master weights and AdamW moments live on their device and are
stepped there after the global norm is known; the host copy is refreshed by ``synchronize``
(state_dict, checkpoints, saving). Every mode, tied and untied embeddings, clipping that
triggers, several devices, resume from a checkpoint, non-finite skip.
"""

from __future__ import annotations

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from reference import compare, randomize_biases, train_both
from tinypipe.schedule.ids import Kind

LR, EPS, WD = 1e-3, 1e-6, 0.1


def _run(family: str, cfg: dict, layers: int = 4, steps: int = 3,
         tied: bool | None = None) -> tinypipe.Engine:
    model = make_model(family, layers=layers, tied=tied)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [make_batch(5, 12, seed=i, pad=i == 1) for i in range(steps)]
    engine, ref = train_both(model, model, batches, cfg, lr=LR, eps=EPS, weight_decay=WD)
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5, f"max per-tensor relative weight error {worst:.2e}"
    assert update_err <= 1e-4, f"relative error of the update {update_err:.2e}"
    return engine


@pytest.mark.parametrize("mode", ["embed", "head", "both"])
@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("gpt2", True), ("opt", True)])
def test_device_optimizer_matches_pytorch(family: str, tied: bool, mode: str) -> None:
    engine = _run(family, dict(devices=["cpu"], pack_size=2, micro_batch_size=2, max_grad_norm=0.5,
                               device_optimizer=mode), tied=tied)
    on_device = engine.memory_report().devices["0:cpu"]["optimizer_state"]
    layers = engine.store.layers
    expect = {"embed": [0], "head": [len(layers) - 1], "both": [0, len(layers) - 1]}[mode]
    assert on_device == sum(12 * layers[i].spec.train_numel for i in expect)
    engine.close()


@pytest.mark.parametrize("cfg", [
    dict(devices=["cpu"] * 2, pack_size=1, micro_batch_size=2, backward_micro_batch_size=3),
    dict(devices=["cpu"] * 3, pack_size=[1, 3, 2], micro_batch_size=1, stash="host", max_grad_norm=0.5),
], ids=["n2_unclipped", "n3_clip_host_stash"])
def test_device_optimizer_on_several_devices(cfg: dict) -> None:
    _run("llama", dict(cfg, device_optimizer="both"), layers=6, tied=False).close()


def test_no_clipping_and_clipping_on_some_steps() -> None:
    cfg = dict(devices=["cpu"], pack_size=1, micro_batch_size=3, device_optimizer="both")
    _run("llama", cfg, steps=4).close()


@pytest.mark.parametrize("placement", [dict(pack_size=2, device_optimizer="both"),
                                       dict(pack_size=1, resident_packs=2)],
                         ids=["embed_head", "resident_packs"])
def test_resume_from_checkpoint_equals_uninterrupted(tmp_path, placement: dict) -> None:
    cfg = tinypipe.Config(devices=["cpu"], micro_batch_size=2, lr=LR, max_grad_norm=0.5, **placement)
    batches = [make_batch(4, 10, seed=i) for i in range(4)]
    a = tinypipe.Engine(make_model("llama"), cfg)
    for b in batches:
        a.step(b)
    b_eng = tinypipe.Engine(make_model("llama"), cfg)
    for b in batches[:2]:
        b_eng.step(b)
    b_eng.save_checkpoint(tmp_path / "ck")
    b_eng.step(make_batch(4, 10, seed=99))  # diverge, then restore: the device state must follow
    b_eng.load_checkpoint(tmp_path / "ck")
    for b in batches[2:]:
        b_eng.step(b)
    sa, sb = a.state_dict(), b_eng.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    oa, ob = a.optimizer_state(), b_eng.optimizer_state()
    assert all(torch.equal(oa[k]["exp_avg_sq"], ob[k]["exp_avg_sq"]) and oa[k]["step"] == ob[k]["step"]
               for k in oa)


def test_host_edits_after_state_dict_reach_the_device() -> None:
    """state_dict() hands out live host views: a change made there is what the next step uses."""
    cfg = tinypipe.Config(devices=["cpu"], pack_size=2, micro_batch_size=2, lr=LR, device_optimizer="embed")
    eng = tinypipe.Engine(make_model("llama"), cfg)
    eng.step(make_batch(4, 8))
    key = next(k for k in eng.state_dict() if "embed_tokens" in k)
    with torch.no_grad():
        eng.state_dict()[key].zero_()
    r = eng.step(make_batch(4, 8, seed=1))
    ref = tinypipe.Engine(make_model("llama"),
                          tinypipe.Config(devices=["cpu"], pack_size=2, micro_batch_size=2, lr=LR))
    ref.step(make_batch(4, 8))
    with torch.no_grad():
        ref.state_dict()[key].zero_()
    assert r.loss == ref.step(make_batch(4, 8, seed=1)).loss
    assert torch.equal(eng.state_dict()[key], ref.state_dict()[key])


def test_nonfinite_skip_leaves_device_layers_unchanged() -> None:
    eng = tinypipe.Engine(make_model("llama"), tinypipe.Config(devices=["cpu"], micro_batch_size=2, lr=LR,
                                                               nonfinite="skip", device_optimizer="both"))
    eng.step(make_batch(4, 8))
    with torch.no_grad():
        eng.state_dict()["model.layers.1.mlp.up_proj.weight"][0, 0] = float("inf")
    weights = {k: v.clone() for k, v in eng.state_dict().items()}
    moments = {k: (v["exp_avg"].clone(), v["step"]) for k, v in eng.optimizer_state().items()}
    r = eng.step(make_batch(4, 8, seed=1))
    assert r.skipped
    for k, v in eng.state_dict().items():
        if "embed_tokens" in k or "lm_head" in k or k == "model.norm.weight":
            assert torch.equal(weights[k], v), k
    for k, v in eng.optimizer_state().items():
        if k in ("embed", "head"):
            assert torch.equal(moments[k][0], v["exp_avg"]) and moments[k][1] == v["step"], k


# ------------------------------------------------------------ resident packs (blocks kept on the device)

@pytest.mark.parametrize("family,tied", [("llama", False), ("gpt2", True), ("qwen2", True)])
@pytest.mark.parametrize("cfg", [
    dict(pack_size=1, micro_batch_size=2, resident_packs=1),
    dict(pack_size=[2, 1, 1], micro_batch_size=2, backward_micro_batch_size=3, resident_packs=2,
         max_grad_norm=0.5, device_optimizer="embed", stash="host"),
    dict(pack_size=2, micro_batch_size=5, resident_packs=2, max_grad_norm=0.5),  # every block resident
], ids=["first_layer", "two_packs_clip_host_stash", "all_resident"])
def test_resident_packs_match_pytorch(family: str, tied: bool, cfg: dict) -> None:
    engine = _run(family, dict(devices=["cpu"], **cfg), tied=tied)
    layers = engine.store.layers
    resident = engine.plan.resident_layers()
    assert resident and all(task.kind is not Kind.UPLOAD or task.layers[0] not in resident
                            for task in engine.schedule_for(5).tasks.values())
    dev = engine.memory_report().devices["0:cpu"]
    stepped_here = resident + ([0] if cfg.get("device_optimizer") == "embed" else [])
    assert dev["optimizer_state"] == sum(12 * layers[i].spec.train_numel for i in stepped_here)
    engine.close()


def test_resident_packs_on_several_devices() -> None:
    # round-robin placement runs pack q's forward on device (1 + q) % n and its backward on
    # (1 + 2P - q) % n: one device when 2(P - q) is a multiple of n. 3 devices, 4 packs: pack 0
    # is split and cannot stay resident; 3 devices, 3 packs: pack 0 can
    from tinypipe.schedule.plan import make_plan

    with pytest.raises(tinypipe.ConfigError, match="resident pack 0"):
        make_plan(4, pack_size=1, micro_batch_size=1, backward_micro_batch_size=1, num_devices=3, prefetch_window=1,
                  stash="device", tied=False, resident_packs=1)
    _run("llama", dict(devices=["cpu"] * 3, pack_size=[1, 2, 1], micro_batch_size=2, resident_packs=1),
         layers=4, tied=False).close()
