"""The SSD tier changes where state lives, never what the numbers are: every offloaded kind, fp32 and
bf16, with and without clipping (speculated, rolled back and deferred steps), non-finite skip and
rollback, 1 and 2 devices, LoRA with its frozen base on the SSD -- losses, gradient norms, weights
and AdamW moments equal the DRAM-only engine's bit for bit (``torch.equal``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from tinypipe.errors import ConfigError
from tinypipe.planner.auto import manual_plan
from tinypipe.schedule.ids import download_id
from tinypipe.schedule.plan import Plan

LR = 1e-2
ALL = ("master", "moments", "grad")


def _plan(cfg: tinypipe.Config, num_blocks: int, tied: bool, offload: list[tuple[int, str]]) -> Plan:
    return dataclasses.replace(manual_plan(cfg, num_blocks=num_blocks, tied=tied), offload=tuple(offload))


def _every(layers: int, kinds: tuple[str, ...]) -> list[tuple[int, str]]:
    return [(layer, k) for layer in range(layers + 2) for k in kinds]


def _run(model: torch.nn.Module, cfg: tinypipe.Config, offload: list[tuple[int, str]], steps: int,
         fault=None, num_blocks: int = 4, tied: bool = False) -> tuple[tinypipe.Engine, list]:
    engine = tinypipe.Engine(model, cfg, plan=_plan(cfg, num_blocks, tied, offload))
    results = []
    for i in range(steps):
        engine.fault = fault(engine, i) if fault is not None else None
        results.append(engine.step(make_batch(4, 12, seed=i)))
    return engine, results


def _assert_same(a: tinypipe.Engine, b: tinypipe.Engine, ra: list, rb: list) -> None:
    assert [r.loss for r in ra] == [r.loss for r in rb]
    assert [r.grad_norm for r in ra] == [r.grad_norm for r in rb]
    assert [(r.clipped, r.skipped) for r in ra] == [(r.clipped, r.skipped) for r in rb]
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    oa, ob = a.optimizer_state(), b.optimizer_state()
    for name in oa:
        assert oa[name]["step"] == ob[name]["step"], name
        if oa[name]["step"]:  # moments of a never-stepped layer are undefined in both
            assert torch.equal(oa[name]["exp_avg"], ob[name]["exp_avg"]), name
            assert torch.equal(oa[name]["exp_avg_sq"], ob[name]["exp_avg_sq"]), name


def _pair(tmp_path: Path, family: str, cfg: dict, offload: list[tuple[int, str]], steps: int = 5,
          fault=None, layers: int = 4) -> tuple[list, list]:
    dram_cfg = tinypipe.Config(lr=LR, **cfg)
    ssd_cfg = dram_cfg.replace(offload_dir=str(tmp_path))
    tied = bool(make_model(family, layers=layers).config.tie_word_embeddings)
    a, ra = _run(make_model(family, layers=layers), dram_cfg, [], steps, fault, layers, tied)
    b, rb = _run(make_model(family, layers=layers), ssd_cfg, offload, steps, fault, layers, tied)
    try:
        _assert_same(a, b, ra, rb)
        assert sum(r.ssd_read_bytes for r in rb) > 0 and sum(r.ssd_write_bytes for r in rb) > 0
        assert all(r.ssd_read_bytes == 0 for r in ra)
    finally:
        a.close()
        b.close()
    assert not list(tmp_path.iterdir()), "scratch left behind after close"
    return ra, rb


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kinds", [("moments",), ("master",), ("grad",), ALL], ids="+".join)
def test_each_kind_with_clipping_is_bit_identical(tmp_path: Path, kinds: tuple[str, ...], precision: str) -> None:
    ra, _ = _pair(tmp_path, "llama", dict(pack_size=2, micro_batch_size=2, precision=precision,
                                          max_grad_norm=1.6), _every(4, kinds))
    clipped = [r.clipped for r in ra]
    assert any(clipped) and not all(clipped), clipped  # speculated, rolled back and deferred steps


@pytest.mark.parametrize("kinds", [("moments",), ("master", "moments")], ids="+".join)
def test_without_clipping_is_bit_identical(tmp_path: Path, kinds: tuple[str, ...]) -> None:
    _pair(tmp_path, "llama", dict(pack_size=1, micro_batch_size=2, prefetch_window=2), _every(4, kinds))


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied and tied embeddings
def test_two_devices_uneven_packs_host_stash(tmp_path: Path, family: str) -> None:
    cfg = dict(devices=["cpu", "cpu"], pack_size=[1, 2, 1], micro_batch_size=3, backward_micro_batch_size=2,
               stash="host", precision="bf16", max_grad_norm=1.3)
    _pair(tmp_path, family, cfg, _every(4, ALL))


def test_three_devices_the_last_pack_uploaded_again_for_its_backward(tmp_path: Path) -> None:
    """Three devices: the last pack's forward and backward run on different devices, so its
    masters are read for a backward upload too (no slots carried over)."""
    cfg = dict(devices=["cpu"] * 3, pack_size=2, micro_batch_size=2, max_grad_norm=1.6)
    plan = manual_plan(tinypipe.Config(**cfg), num_blocks=4, tied=False)
    assert plan.fwd_device[-1] != plan.bwd_device[-1]
    _pair(tmp_path, "llama", cfg, _every(4, ALL))


def test_some_layers_and_kinds_only(tmp_path: Path) -> None:
    offload = [(0, "moments"), (1, "master"), (2, "grad"), (2, "moments"), (4, "master"), (5, "master"),
               (5, "moments")]
    _pair(tmp_path, "llama", dict(devices=["cpu", "cpu"], pack_size=2, micro_batch_size=2, max_grad_norm=1.6),
          offload)


def test_with_layers_stepped_on_the_device(tmp_path: Path) -> None:
    """Embedding, head and the first pack stay on their device (never offloaded); the rest does."""
    offload = [(layer, k) for layer in (3, 4) for k in ALL]
    _pair(tmp_path, "llama", dict(pack_size=2, micro_batch_size=2, device_optimizer="both", resident_packs=1,
                                  max_grad_norm=1.6), offload)


def _inf_in_embedding_grad(at_step: int):
    def make(engine: tinypipe.Engine, i: int):
        if i != at_step:
            return None

        def fault(task) -> None:
            if task.id == download_id(0):
                engine.devices[0].pool.grads(0, None)[0] = float("inf")
        return fault
    return make


def test_nonfinite_skip_is_bit_identical(tmp_path: Path) -> None:
    ra, _ = _pair(tmp_path, "llama", dict(pack_size=2, micro_batch_size=2, nonfinite="skip", max_grad_norm=1.6),
                  _every(4, ALL), fault=_inf_in_embedding_grad(2))
    assert [r.skipped for r in ra] == [False, False, True, False, False]


def test_nonfinite_raise_rolls_back_the_same(tmp_path: Path) -> None:
    """Clipping retains the gradients; a non-finite embedding gradient (the last one) rolls every
    speculatively stepped layer back -- from the SSD here, reading the gradients written there."""
    cfg = tinypipe.Config(lr=LR, pack_size=2, micro_batch_size=2, max_grad_norm=100.0)
    engines = []
    for offload, c in (([], cfg), (_every(4, ALL), cfg.replace(offload_dir=str(tmp_path)))):
        engine, _ = _run(make_model("llama"), c, offload, 2)
        engine.fault = _inf_in_embedding_grad(0)(engine, 0)
        with pytest.raises(tinypipe.NonFiniteError, match="rolled back"):
            engine.step(make_batch(4, 12, seed=7))
        engine.fault = None
        engines.append((engine, [engine.step(make_batch(4, 12, seed=8))]))
    (a, ra), (b, rb) = engines
    _assert_same(a, b, ra, rb)
    a.close()
    b.close()


def test_lora_with_its_frozen_base_on_the_ssd(tmp_path: Path) -> None:
    from tinypipe.lora import LoraSettings, apply_lora, merged_tensors

    settings = LoraSettings(rank=4, alpha=8)
    dram_cfg = tinypipe.Config(lr=LR, pack_size=2, micro_batch_size=2, precision="bf16", max_grad_norm=0.05)
    out = []
    for offload, cfg in (([], dram_cfg), (_every(4, ("frozen", "moments")),
                                          dram_cfg.replace(offload_dir=str(tmp_path)))):
        engine, results = _run(apply_lora(make_model("llama"), settings), cfg, offload, 4)
        engine.synchronize()  # a clipped step's update finishes in the background
        merged = {k: v.clone() for k, v in merged_tensors(engine.peft_model, engine.store)}
        out.append((engine, results, merged))
    (a, ra, ma), (b, rb, mb) = out
    assert b.store.frozen_bytes == 0 and a.store.frozen_bytes > 0  # the base lives on the SSD only
    _assert_same(a, b, ra, rb)
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    adapter_a, adapter_b = a.save_pretrained(tmp_path / "a_out"), b.save_pretrained(tmp_path / "b_out")
    assert (adapter_a / "adapter_model.safetensors").read_bytes() == (adapter_b / "adapter_model.safetensors"
                                                                      ).read_bytes()
    a.close()
    b.close()


def test_offloaded_masters_are_not_in_dram_and_readers_use_the_ssd(tmp_path: Path) -> None:
    model = make_model("llama")
    cfg = tinypipe.Config(lr=LR, pack_size=2, micro_batch_size=2, offload_dir=str(tmp_path / "ssd"))
    (tmp_path / "ssd").mkdir()
    engine = tinypipe.Engine(model, cfg, plan=_plan(cfg, 4, False, _every(4, ("master", "moments"))))
    assert engine.store.master_bytes == 0 and engine.store.optimizer_bytes == 0
    assert all(p.device.type == "meta" for p in model.parameters())  # no DRAM copy left behind
    report = engine.memory_report()
    assert report.ssd["master"] == report.ssd["moments"] // 2 > 0
    assert report.host["ssd_staging_pool"] > 0 and "on SSD" in report.to_text()
    engine.step(make_batch(4, 12))
    ref = tinypipe.Engine(make_model("llama"), tinypipe.Config(lr=LR, pack_size=2, micro_batch_size=2))
    ref.step(make_batch(4, 12))
    engine.save_pretrained(tmp_path / "ssd_out")
    ref.save_pretrained(tmp_path / "ref_out")
    assert (tmp_path / "ssd_out" / "model.safetensors").read_bytes() == (
        tmp_path / "ref_out" / "model.safetensors").read_bytes()
    engine.close()
    ref.close()
    assert not list((tmp_path / "ssd").iterdir())


def test_checkpoints_hold_the_state_and_load_back_into_scratch(tmp_path: Path) -> None:
    """A checkpoint of an SSD run is an ordinary checkpoint (the DRAM engine resumes it, and an SSD
    engine resumes a DRAM one's), and resuming gives the uninterrupted run's numbers."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    cfg = tinypipe.Config(lr=LR, pack_size=2, micro_batch_size=2, max_grad_norm=1.6)
    offload = _every(4, ALL)
    straight, rs = _run(make_model("llama"), cfg.replace(offload_dir=str(ssd)), offload, 5)
    first, _ = _run(make_model("llama"), cfg.replace(offload_dir=str(ssd)), offload, 3)
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    resumed = []
    for c, off in ((cfg.replace(offload_dir=str(ssd)), offload), (cfg, [])):
        engine = tinypipe.Engine(make_model("llama", seed=5), c, plan=_plan(c, 4, False, off))
        engine.load_checkpoint(tmp_path / "ckpt")
        resumed.append((engine, [engine.step(make_batch(4, 12, seed=i)) for i in (3, 4)]))
    for engine, results in resumed:
        _assert_same(straight, engine, rs[3:], results)
        engine.close()
    straight.close()


def test_bad_offload_settings_are_one_line_errors(tmp_path: Path) -> None:
    cfg = tinypipe.Config(pack_size=2, micro_batch_size=2)
    with pytest.raises(ConfigError, match="no offload directory is set"):
        tinypipe.Engine(make_model("llama"), cfg, plan=_plan(cfg, 4, False, [(1, "moments")]))
    with pytest.raises(ConfigError, match="offload kind must be one of"):
        _plan(cfg, 4, False, [(1, "activations")])
    with pytest.raises(ConfigError, match="offload layer must be in 0..5"):
        _plan(cfg, 4, False, [(6, "master")])
    dev = cfg.replace(device_optimizer="embed")
    with pytest.raises(ConfigError, match="layer 0 is stepped on its device"):
        _plan(dev, 4, False, [(0, "moments")])
    from tinypipe.lora import LoraSettings, apply_lora

    lcfg = cfg.replace(offload_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="offloads its master"):
        tinypipe.Engine(apply_lora(make_model("llama"), LoraSettings(rank=2)), lcfg,
                        plan=_plan(lcfg, 4, False, [(1, "master")]))
    with pytest.raises(tinypipe.errors.StorageError, match="does not exist"):
        tinypipe.Engine(make_model("llama"), cfg.replace(offload_dir=str(tmp_path / "nope")),
                        plan=_plan(cfg, 4, False, [(1, "moments")]))


def test_plan_offload_json_and_description() -> None:
    cfg = tinypipe.Config(pack_size=2, micro_batch_size=2)
    plan = _plan(cfg, 4, False, [(3, "moments"), (1, "master"), (1, "moments"), (3, "moments")])
    assert plan.offload == ((1, "master"), (1, "moments"), (3, "moments"))  # sorted, no duplicates
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.describe().endswith(", offload: moments of 2 layers, master of 1")
    assert plan.describe(ssd_bytes=3 << 30).endswith("master of 1 (3.0 GiB on SSD)")
    old = manual_plan(cfg, num_blocks=4, tied=False)
    assert "offload" not in old.describe()
    text = old.to_json().replace('"offload": [],', "").replace(',\n "offload": []', "")
    assert "offload" not in text and Plan.from_json(text).offload == ()  # files from before the tier
