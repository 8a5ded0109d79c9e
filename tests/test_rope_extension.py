"""Context extension (``--extend-context``): a sequence beyond the model's positions trains with
its RoPE scaled by the standard scheme for its kind, and the saved model reloads with the same
frequencies; without the flag such a length is refused in one line that names the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from _data_helpers import tiny_llama_and_corpus
from tinypipe import cli
from tinypipe.errors import ConfigError
from tinypipe.models.rope_extension import extend_rope, rope_parameters

LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)


def _llama(max_pos: int, **over: object) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, num_hidden_layers=1,
                                    intermediate_size=64, max_position_embeddings=max_pos, **over)


def test_plain_rope_becomes_yarn_over_the_old_length() -> None:
    """YaRN keeps the fastest-rotating dimensions and interpolates the slowest by the factor."""
    cfg = _llama(1024)
    before = LlamaRotaryEmbedding(cfg).inv_freq.clone()
    assert "YaRN x4" in extend_rope(cfg, 4096)
    assert cfg.max_position_embeddings == 4096
    params = rope_parameters(cfg)
    assert params["rope_type"] == "yarn" and params["factor"] == 4.0
    assert params["original_max_position_embeddings"] == 1024 and params["rope_theta"] == 10000.0
    after = LlamaRotaryEmbedding(cfg).inv_freq
    assert torch.equal(after[:8], before[:8])  # wavelengths far below 1024: untouched
    torch.testing.assert_close(after[-1], before[-1] / 4, rtol=1e-6, atol=0)  # the slowest: interpolated


def test_llama31_scaling_doubles_its_factor_and_keeps_its_pretraining_length() -> None:
    cfg = _llama(131072, rope_scaling=dict(LLAMA31_ROPE), rope_theta=500000.0)
    before = LlamaRotaryEmbedding(cfg).inv_freq.clone()
    assert extend_rope(cfg, 262144).endswith("llama3 factor 8 -> 16")
    params = rope_parameters(cfg)
    assert params["factor"] == 16.0 and params["original_max_position_embeddings"] == 8192
    after = LlamaRotaryEmbedding(cfg).inv_freq
    assert torch.equal(after[:16], before[:16])  # high frequencies: llama3 never scales them
    torch.testing.assert_close(after[-1], before[-1] / 2, rtol=1e-6, atol=0)  # 1/8 -> 1/16


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_factor_kinds_multiply_their_factor(kind: str) -> None:
    cfg = _llama(8192, rope_scaling={"rope_type": kind, "factor": 2.0, "original_max_position_embeddings": 4096})
    extend_rope(cfg, 32768)
    assert rope_parameters(cfg)["factor"] == 8.0 and cfg.max_position_embeddings == 32768


def test_nothing_changes_within_range_and_odd_models_are_refused() -> None:
    cfg = _llama(4096)
    assert extend_rope(cfg, 4096) == "" and rope_parameters(cfg)["rope_type"] == "default"
    dynamic = _llama(4096, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "dynamic" in extend_rope(dynamic, 8192) and rope_parameters(dynamic)["factor"] == 2.0
    with pytest.raises(ConfigError, match="no rotary position embedding"):
        extend_rope(transformers.OPTConfig(max_position_embeddings=2048), 4096)
    odd = _llama(4096, rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 64,
                                     "long_factor": [1.0] * 64, "original_max_position_embeddings": 4096})
    with pytest.raises(ConfigError, match="'longrope' is not one --extend-context scales"):
        extend_rope(odd, 8192)


def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_finetune_beyond_the_positions_needs_the_flag_and_trains_and_saves_the_extension(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny Llama reaches 128 positions: 256-token rows are refused without the flag; with it the
    engine's rotary table is YaRN x2's (not the original), the saved config carries it, and the
    saved model reloads with the very frequencies it trained with."""
    import tinypipe.runtime.engine as engine_module

    model_dir, data = tiny_llama_and_corpus(tmp_path)
    base = ["finetune", "--model", model_dir, "--data", data, "--seq-len", 256, "--global-batch", 2,
            "--steps", 2, "--devices", "cpu", "--no-progress"]
    code, _, err = _run(capsys, *base, "--output", tmp_path / "refused")
    assert code == 2 and "exceeds the model's max_position_embeddings 128" in err and "--extend-context" in err

    engines: list = []

    class Capturing(engine_module.Engine):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(engine_module, "Engine", Capturing)
    out_dir = tmp_path / "out"
    code, out, err = _run(capsys, *base, "--output", out_dir, "--extend-context")
    assert code == 0, err
    assert "context: 256 positions (RoPE yarn, factor 2 over 128)" in out
    original = LlamaRotaryEmbedding(transformers.AutoConfig.from_pretrained(model_dir)).inv_freq
    trained = engines[0].model.model.rotary_emb.inv_freq
    assert not torch.equal(trained, original)
    saved = json.loads((out_dir / "config.json").read_text())
    assert saved["max_position_embeddings"] == 256
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    assert torch.equal(reloaded.model.rotary_emb.inv_freq, trained)
    assert reloaded.model.rotary_emb.attention_scaling == engines[0].model.model.rotary_emb.attention_scaling


def test_finetune_extend_context_needs_a_seq_len(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir, data = tiny_llama_and_corpus(tmp_path)
    code, _, err = _run(capsys, "finetune", "--model", model_dir, "--data", data, "--output", tmp_path / "o",
                        "--devices", "cpu", "--extend-context")
    assert code == 2 and "--extend-context needs --seq-len" in err


def test_plan_at_256k_for_llama31_with_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "llama-3.1-8b", "--seq-len", 262144, "--global-batch", 1, "--gpu-memory", "24GiB",
            "--cpu-memory", "128GiB", "--lora", "--quantize", "nf4", "--hardware", "h200-pcie5"]
    code, _, err = _run(capsys, *args)
    assert code == 2 and "max_position_embeddings 131072 (--extend-context" in err
    code, out, err = _run(capsys, *args, "--extend-context")
    assert code == 0, err
    assert out.startswith("model: llama-3.1-8b ") and "1 x 262144 tokens/step" in out
