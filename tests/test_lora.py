"""LoRA through the engine (issue #6).

The core invariant: training LoRA adapters through tinypipe (any packing, micro-batching, 1-2
devices, clipping) gives the same adapter weights as plain single-device PyTorch + PEFT training
with ``torch.optim.AdamW`` over the adapters on the same global batch (fp32: to float rounding),
and leaves the base weights untouched. Plus: host memory (frozen base at 2 B/param in bf16, no
master/moments for it), the PEFT adapter and merged-model round trips through transformers and
peft, checkpoint/resume, settings validation and the ``finetune --lora`` command.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import peft
import pytest
import torch
import transformers

import tinypipe
from model_zoo import make_batch, make_model
from reference import compare, train_both
from tinypipe.lora import LoraSettings, apply_lora, default_targets, merged_tensors, save_merged

LR, EPS, WD = 1e-3, 1e-6, 0.1
BATCH, SEQ, STEPS = 5, 12, 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: one intra-op thread is several times faster than an OpenMP team
    (which stalls whenever another process takes a core of a shared box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def lora_model(family: str, layers: int = 4, rank: int = 4, targets: list[str] | None = None,
               tied: bool | None = None) -> peft.PeftModel:
    """A zoo model with LoRA adapters whose B matrices are random too (PEFT starts B at zero, which
    would make the first step's A-gradients vanish and hide errors)."""
    pm = apply_lora(make_model(family, layers=layers, tied=tied), LoraSettings(rank=rank, alpha=2.0 * rank, targets=targets))
    return randomize_lora_b(pm)


def randomize_lora_b(pm: peft.PeftModel) -> peft.PeftModel:
    """Give every LoRA B matrix seeded random values (PEFT's zeros hide A-gradient errors)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return pm


def trainable(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in names}


def run_both(family: str, cfg: dict, layers: int = 4, targets: list[str] | None = None, pad: bool = True) -> tinypipe.Engine:
    pm = lora_model(family, layers=layers, targets=targets)
    inner = pm.base_model.model
    init = {k: v.clone() for k, v in inner.state_dict().items()}
    batches = [make_batch(BATCH, SEQ, seed=i, pad=pad and i == 1) for i in range(STEPS)]
    engine, ref = train_both(pm, inner, batches, cfg, lr=LR, eps=EPS, weight_decay=WD)
    state = engine.state_dict()
    adapters = trainable(state, ref.model)
    assert adapters and all(".lora_" in k for k in adapters)
    worst, update_err = compare(adapters, _Only(ref.model, adapters), {k: init[k] for k in adapters})
    assert worst <= 1e-5, f"max per-tensor relative adapter error {worst:.2e}"
    assert update_err <= 1e-4, f"relative error of the adapter update {update_err:.2e}"
    for k, v in state.items():  # the base never moves
        if k not in adapters:
            assert torch.equal(v, init[k]), k
    return engine


class _Only:
    """``compare`` wants a module with ``state_dict()``; restrict the reference to the adapters."""

    def __init__(self, model: torch.nn.Module, keys: dict) -> None:
        self._sd = {k: v for k, v in model.state_dict().items() if k in keys}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._sd


CONFIGS = {
    "layerwise_mb2": dict(devices=["cpu"], pack_size=1, micro_batch_size=2),
    "packs2_mb2_bwd3_clip_triggers": dict(devices=["cpu"], pack_size=2, micro_batch_size=2,
                                          backward_micro_batch_size=3, prefetch_window=2, max_grad_norm=0.05),
    "n2_packs2_host_stash": dict(devices=["cpu", "cpu"], pack_size=2, micro_batch_size=2, stash="host"),
    "n2_uneven_mb1": dict(devices=["cpu", "cpu"], pack_size=[1, 3], micro_batch_size=1, backward_micro_batch_size=2,
                          max_grad_norm=100.0),
    # resident packs hold frozen weights and adapters; only the adapters are stepped on the device
    "resident_packs_clip": dict(devices=["cpu"], pack_size=1, micro_batch_size=2, resident_packs=2,
                                device_optimizer="both", max_grad_norm=0.05),
}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_lora_matches_peft_and_torch_adamw(family: str, name: str) -> None:
    run_both(family, dict(CONFIGS[name])).close()


@pytest.mark.parametrize("family", ["qwen2", "opt"])
def test_lora_other_families_and_some_targets(family: str) -> None:
    """Tied (qwen2) and untied (opt) embeddings; adapters on a subset of the projections."""
    run_both(family, dict(devices=["cpu", "cpu"], pack_size=2, micro_batch_size=2), targets=["q_proj", "v_proj"]).close()


def test_default_targets_are_the_block_projections() -> None:
    assert default_targets(make_model("llama", layers=1)) == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert sorted(default_targets(make_model("gpt2", layers=1))) == ["c_attn", "c_fc", "c_proj"]



def test_wrapping_warns_nothing() -> None:
    """peft reads transformers' deprecated gradient-checkpointing alias; the user sees no
    FutureWarning for it on every wrap (every LoRA plan)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped = apply_lora(make_model("llama"), LoraSettings(rank=4))
    assert isinstance(wrapped, peft.PeftModel)

def test_bf16_host_memory_frozen_base_two_bytes_per_param() -> None:
    pm = lora_model("llama")
    inner = pm.base_model.model
    n_frozen = sum(p.numel() for p in inner.parameters() if not p.requires_grad)
    n_train = sum(p.numel() for p in inner.parameters() if p.requires_grad)
    fp32 = copy.deepcopy(inner)
    engine = tinypipe.Engine(pm, tinypipe.Config(devices=["cpu"], precision="bf16", pack_size=2, micro_batch_size=2, lr=LR))
    host = engine.memory_report().host
    layers = engine.decomposition.layers
    assert host["frozen_weights"] == 2 * sum(s.frozen_numel for s in layers)
    assert host["master_weights"] == 4 * sum(s.train_numel for s in layers)
    assert host["optimizer_state"] == 8 * sum(s.train_numel for s in layers)
    slack = 64 * sum(len(s.params) for s in layers)  # per-parameter alignment padding, at most
    assert 2 * n_frozen <= host["frozen_weights"] <= 2 * (n_frozen + slack)
    assert 4 * n_train <= host["master_weights"] <= 4 * (n_train + slack)
    for name, p in inner.named_parameters():  # the model's base weights are the bf16 host copy
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
    # the device slots hold whole layers; gradient accumulators only the adapters
    pool = engine.devices[0].pool
    assert all(g.numel() == max(s.train_numel for s in layers[1:-1]) for g in pool.grad_slots)
    assert all(g.numel() == 0 for g in pool.resident_grads.values())  # frozen embedding and head
    assert all(t.numel() == max(s.numel for s in layers[1:-1]) for t in pool.slots)
    batch = make_batch(BATCH, SEQ, seed=0)
    with torch.no_grad():
        want = float(fp32(**batch, labels=batch["input_ids"]).loss)
    r = engine.step(batch)
    assert abs(r.loss - want) < 2e-2 * want  # bf16 compute
    r2 = engine.step(batch)
    assert r2.loss < r.loss
    engine.close()


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _trained(family: str, tmp_path: Path) -> tuple[tinypipe.Engine, peft.PeftModel]:
    pm = lora_model(family, layers=3)
    engine = tinypipe.Engine(pm, tinypipe.Config(devices=["cpu"], pack_size=2, micro_batch_size=2, lr=1e-2))
    for i in range(2):
        engine.step(make_batch(BATCH, SEQ, seed=i))
    return engine, pm


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_adapter_and_merged_round_trip(family: str, tmp_path: Path) -> None:
    engine, pm = _trained(family, tmp_path)
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(5))
    trained = _logits(engine.model, ids)

    adapter = engine.save_pretrained(tmp_path / "adapter")
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    loaded = peft.PeftModel.from_pretrained(make_model(family, layers=3), adapter)
    torch.testing.assert_close(_logits(loaded, ids), trained, rtol=1e-6, atol=1e-6)
    base = _logits(make_model(family, layers=3), ids)
    assert not torch.allclose(base, trained, atol=1e-3), "the adapter changed nothing"

    merged_dir = save_merged(engine, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    assert not any("lora" in k or "base_layer" in k for k in merged.state_dict())
    torch.testing.assert_close(_logits(merged, ids), trained, rtol=1e-5, atol=1e-5)
    reference = loaded.merge_and_unload()  # PEFT's own merge of the saved adapter
    want = reference.state_dict()
    for k, v in merged.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=1e-6, atol=1e-7, msg=k)
    engine.close()


def test_save_merged_right_after_a_step_writes_the_final_weights(tmp_path: Path) -> None:
    """Resident packs are stepped on their device and clipping defers work past the step: the host
    copy is final only after synchronize(), which save_merged must do itself."""
    pm = lora_model("llama", layers=4)
    engine = tinypipe.Engine(pm, tinypipe.Config(**CONFIGS["resident_packs_clip"], lr=1e-2))
    for i in range(2):
        engine.step(make_batch(BATCH, SEQ, seed=i))
    merged_dir = save_merged(engine, tmp_path / "merged")  # nothing read the engine before
    engine.synchronize()
    want = dict(merged_tensors(pm, engine.store))
    got = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in got
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
    engine.close()


def test_checkpoint_resume_equals_uninterrupted(tmp_path: Path) -> None:
    batches = [make_batch(BATCH, SEQ, seed=i, pad=i == 1) for i in range(4)]
    cfg = tinypipe.Config(devices=["cpu", "cpu"], pack_size=2, micro_batch_size=2, lr=LR, max_grad_norm=0.05)
    straight = tinypipe.Engine(lora_model("llama"), cfg)
    want = [straight.step(b).loss for b in batches]

    first = tinypipe.Engine(lora_model("llama"), cfg)
    got = [first.step(b).loss for b in batches[:2]]
    first.save_checkpoint(tmp_path / "ckpt", extra={"step": 2})
    ckpt_bytes = sum(f.stat().st_size for f in (tmp_path / "ckpt").iterdir())
    assert ckpt_bytes < 4 * 12 * sum(s.train_numel for s in first.decomposition.layers) + 64 * 1024  # adapters only
    resumed = tinypipe.Engine(lora_model("llama"), cfg)
    assert resumed.load_checkpoint(tmp_path / "ckpt") == {"step": 2}
    got += [resumed.step(b).loss for b in batches[2:]]
    assert got == want
    a, b = straight.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    full = tinypipe.Engine(make_model("llama"), tinypipe.Config(devices=["cpu"]))
    with pytest.raises(tinypipe.ConfigError, match="LoRA"):
        full.load_checkpoint(tmp_path / "ckpt")


def test_settings_are_validated() -> None:
    for bad in (dict(rank=0), dict(rank=2.5), dict(alpha=0), dict(alpha=float("nan")), dict(dropout=1.0),
                dict(dropout=-0.1), dict(targets=[]), dict(targets=[3])):
        with pytest.raises(tinypipe.ConfigError):
            LoraSettings(**bad)
    with pytest.raises(tinypipe.ConfigError, match="no_such_proj"):
        apply_lora(make_model("llama", layers=1), LoraSettings(targets=["q_proj", "no_such_proj"]))
    with pytest.raises(tinypipe.ConfigError, match="lm_head"):
        apply_lora(make_model("llama", layers=1), LoraSettings(targets=["lm_head"]))


# --------------------------------------------------------------------------- the command


def test_finetune_lora_merge_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from _data_helpers import make_tokenizer, tiny_llama_and_corpus
    from tinypipe import cli

    model_dir, data = tiny_llama_and_corpus(tmp_path)
    settings = tmp_path / "lora.toml"
    settings.write_text('lora = true\nlora_rank = 4\nlora_alpha = 8\nlora_targets = ["q_proj", "v_proj", "down_proj"]\n')
    out = tmp_path / "out"
    base = ["finetune", "--model", model_dir, "--data", data, "--seq-len", "16", "--global-batch", "4",
            "--micro-batch", "2", "--lr", "1e-2", "--devices", "cpu", "--no-progress"]

    def run(*argv: object) -> tuple[int, str, str]:
        code = cli.main([str(a) for a in argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    for extra, needle in ((["--lora-rank", "0"], "lora_rank"), (["--lora-dropout", "1.5"], "lora_dropout"),
                          (["--lora-targets", "qq_proj"], "qq_proj"), (["--lora-alpha", "-2"], "lora_alpha")):
        code, _, err = run(*base, "--output", out, "--lora", *extra)
        assert code == 2, err
        lines = [x for x in err.splitlines() if x.startswith("tinypipe: error:")]
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
    code, _, err = run(*base, "--output", out, "--merge")
    assert code == 2 and "needs --lora" in err

    code, stdout, err = run(*base, "--output", out, "--config", settings, "--steps", "3", "--merge")
    assert code == 0, err
    assert "LoRA: rank 4" in stdout and "frozen_weights" in stdout
    adapter_cfg = json.loads((out / "adapter_config.json").read_text())
    assert sorted(adapter_cfg["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    ids = torch.randint(0, len(make_tokenizer()), (2, 12), generator=torch.Generator().manual_seed(0))
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = _logits(original, ids)
    with_adapter = _logits(peft.PeftModel.from_pretrained(original, out), ids)
    merged = _logits(transformers.AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32), ids)
    torch.testing.assert_close(merged, with_adapter, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, with_adapter, atol=1e-4), "training changed nothing"
    assert (out / "merged" / "tokenizer.json").is_file() or (out / "merged" / "tokenizer_config.json").is_file()
