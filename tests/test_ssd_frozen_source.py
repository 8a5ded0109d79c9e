"""LoRA's frozen base on the SSD tier, read from the model's own safetensors files: a real checkpoint
saved with ``save_pretrained`` (fp32 and bf16 on disk), loaded by tinypipe's streaming loader, LoRA
applied, every layer's frozen weights offloaded -- no scratch byte holds them, nothing is written
for them, the reads come from the checkpoint (cast to the compute dtype where the file stores
another), and losses, gradient norms, adapter weights, moments and the merged model equal the
DRAM-only engine's bit for bit (fp32 and bf16 compute). A frozen weight changed after loading no longer matches its file:
that layer keeps a scratch copy, and the run is still exact."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from tinypipe.lora import LoraSettings, apply_lora, merged_tensors
from tinypipe.planner.auto import manual_plan
from tinypipe.train.model_io import load_model

LR = 1e-2
SETTINGS = LoraSettings(rank=4, alpha=8)


def _checkpoint(tmp_path: Path, dtype: torch.dtype) -> Path:
    out = tmp_path / f"ckpt_{str(dtype).split('.')[-1]}"
    model = make_model("llama", layers=4)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    return out


def _engine(folder: Path, cfg: tinypipe.Config, offload: bool, mutate: str = "") -> tinypipe.Engine:
    model, _ = load_model(folder, tokenizer=False)
    weight = model.model.layers[1].mlp.down_proj.weight  # a frozen weight of block 1 changes
    if mutate == "in_place":  # seen by the version counter
        with torch.no_grad():
            weight.mul_(0.5)
    elif mutate == "data":  # through .data (its own version counter): seen by the sampled comparison
        weight.data.mul_(0.5)
    torch.manual_seed(0)  # the adapters' initialisation
    peft = apply_lora(model, SETTINGS)
    plan = manual_plan(cfg, num_blocks=4, tied=bool(model.config.tie_word_embeddings))
    if offload:
        plan = dataclasses.replace(plan, offload=tuple((layer, k) for layer in range(6)
                                                       for k in ("frozen", "moments")))
    return tinypipe.Engine(peft, cfg, plan=plan)


def _train(engine: tinypipe.Engine) -> list:
    out = [engine.step(make_batch(4, 12, seed=i)) for i in range(4)]
    engine.synchronize()
    return out


def _same(a: tinypipe.Engine, b: tinypipe.Engine, ra: list, rb: list) -> None:
    assert [r.loss for r in ra] == [r.loss for r in rb]
    assert [r.grad_norm for r in ra] == [r.grad_norm for r in rb]
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    oa, ob = a.optimizer_state(), b.optimizer_state()
    for name in oa:
        if oa[name]["step"]:
            assert torch.equal(oa[name]["exp_avg"], ob[name]["exp_avg"]), name
            assert torch.equal(oa[name]["exp_avg_sq"], ob[name]["exp_avg_sq"]), name


@pytest.mark.parametrize("stored, precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16"),
                                               (torch.float32, "bf16"), (torch.bfloat16, "fp32")])
def test_frozen_base_read_from_the_checkpoint_is_exact(tmp_path: Path, stored: torch.dtype,
                                                       precision: str) -> None:
    folder = _checkpoint(tmp_path, stored)
    cfg = tinypipe.Config(lr=LR, pack_size=2, micro_batch_size=2, precision=precision, max_grad_norm=0.05)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    dram = _engine(folder, cfg, offload=False)
    tier = _engine(folder, cfg.replace(offload_dir=str(ssd)), offload=True)
    off = tier.store.offload
    frozen_keys = {k for k in off.regions if k[1] == "frozen"}
    assert frozen_keys and set(off.external) == frozen_keys  # every frozen region is the checkpoint's
    assert tier.store.frozen_bytes == 0 and dram.store.frozen_bytes > 0
    moments = sum(off.nbytes(k) for k in off.regions if k[1] != "frozen")
    assert off.ssd.nbytes == sum(-(-off.nbytes(k) // 4096) * 4096 for k in off.regions if k[1] != "frozen")
    assert off.ssd.nbytes < moments + 4096 * len(off.regions)  # no scratch for the base
    assert {e.path for k in frozen_keys for e in off.external[k].extents} <= {
        str(p) for p in folder.glob("*.safetensors")}
    ra, rb = _train(dram), _train(tier)
    assert tier.optimizer.tier.last_io.read_bytes > moments  # the base was read (from the checkpoint)
    _same(dram, tier, ra, rb)
    # the merged model (base + adapters) reads the base back through the same checkpoint regions
    ma, mb = ({k: v.clone() for k, v in merged_tensors(e.peft_model, e.store)} for e in (dram, tier))
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    dram.close()
    tier.close()
    assert not list(ssd.iterdir())


@pytest.mark.parametrize("mutate", ["in_place", "data"])
def test_a_weight_changed_after_loading_gets_a_scratch_copy(tmp_path: Path, mutate: str) -> None:
    folder = _checkpoint(tmp_path, torch.float32)
    cfg = tinypipe.Config(lr=LR, pack_size=2, micro_batch_size=2)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    dram = _engine(folder, cfg, offload=False, mutate=mutate)
    tier = _engine(folder, cfg.replace(offload_dir=str(ssd)), offload=True, mutate=mutate)
    off = tier.store.offload
    assert (2, "frozen") not in off.external  # block 1 (layer 2) no longer matches its file
    assert {(0, "frozen"), (1, "frozen"), (3, "frozen")} <= set(off.external)
    assert off.ssd.nbytes >= off.nbytes((2, "frozen"))
    _same(dram, tier, _train(dram), _train(tier))
    dram.close()
    tier.close()


def test_a_model_not_from_files_uses_scratch(tmp_path: Path) -> None:
    cfg = tinypipe.Config(lr=LR, pack_size=2, micro_batch_size=2, offload_dir=str(tmp_path))
    peft = apply_lora(make_model("llama", layers=4), SETTINGS)
    plan = dataclasses.replace(manual_plan(cfg, num_blocks=4, tied=False),
                               offload=tuple((layer, "frozen") for layer in range(6)))
    engine = tinypipe.Engine(peft, cfg, plan=plan)
    assert engine.store.offload.external == {}
    engine.step(make_batch(4, 12))
    engine.close()
