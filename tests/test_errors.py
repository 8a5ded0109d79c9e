"""Issue #7's list of input and environment errors, each through the command line: one line
``tinypipe: error: ...``, exit status 2, no traceback (``tinypipe plan`` with nothing fitting: exit 1,
as documented). Items already covered in test_cli.py are named there; the rest are here."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import transformers

from _data_helpers import CORPUS, make_tokenizer, write_jsonl
from test_cli import assert_one_line_error, data_file, run_cli, tiny_model_dir  # noqa: F401 - fixtures
from tinypipe.memory import budget
from tinypipe.runtime import build as build_module
from tinypipe.runtime import checkpoint as ckpt_module
from tinypipe.train.loop import read_metrics


def _base(model: Path, data: Path, out: Path, *extra: object) -> list[object]:
    return ["finetune", "--model", model, "--data", data, "--output", out, "--seq-len", "16", "--global-batch", "4",
            "--micro-batch", "2", "--steps", "3", "--devices", "cpu", "--no-progress", *extra]


def _fails(capsys: pytest.CaptureFixture[str], argv: list[object], *needles: str, code: int = 2) -> str:
    got, _, err = run_cli(capsys, *argv)
    assert got == code, err
    return assert_one_line_error(err, *needles)


# --------------------------------------------------------------------------- the model


def test_ill_formed_model_dir(capsys, tmp_path: Path, tiny_model_dir: Path, data_file: Path) -> None:  # noqa: F811
    """(Missing dir, no config.json, no weights: test_cli.py.) A broken config.json, a truncated
    weights file."""
    bad_config = tmp_path / "bad_config"
    shutil.copytree(tiny_model_dir, bad_config)
    (bad_config / "config.json").write_text("{not json")
    _fails(capsys, _base(bad_config, data_file, tmp_path / "o"), "config.json")

    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_model_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    _fails(capsys, _base(truncated, data_file, tmp_path / "o"), str(truncated), "model.safetensors", "corrupt")


def test_unsupported_architecture_one_line(capsys, tmp_path: Path, data_file: Path) -> None:  # noqa: F811
    t5 = tmp_path / "t5"
    t5.mkdir()
    transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, vocab_size=50).save_pretrained(t5)
    (t5 / "model.safetensors").write_bytes(b"")
    _fails(capsys, _base(t5, data_file, tmp_path / "o"), "encoder-decoder")

    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    (odd / "model.safetensors").write_bytes(b"")
    _fails(capsys, _base(odd, data_file, tmp_path / "o"), "no-such-architecture")


def test_tokenizer_larger_than_the_models_embedding(capsys, tmp_path: Path, data_file: Path) -> None:  # noqa: F811
    """The tokenizer (~400 tokens) is not the model's (100 embedding rows): said before step 1."""
    tok = make_tokenizer()
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id)
    folder = tmp_path / "small_vocab"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    assert len(tok) > 100
    line = _fails(capsys, _base(folder, data_file, tmp_path / "o"), "tokenizer does not match the model", "100 rows")
    metrics = tmp_path / "o" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip(), line  # no step ran


# --------------------------------------------------------------------------- the data


def test_empty_and_too_little_data(capsys, tmp_path: Path, tiny_model_dir: Path) -> None:  # noqa: F811
    """(A malformed line: test_cli.py.) Empty JSONL, a blank text file, fewer rows than one batch."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _fails(capsys, _base(tiny_model_dir, empty, tmp_path / "o"), str(empty))
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n")
    _fails(capsys, _base(tiny_model_dir, blank, tmp_path / "o"), str(blank))
    short = write_jsonl(tmp_path / "short.jsonl", [{"text": CORPUS[0]}])
    # packing pads a short example into a row of its own: one row, fewer than one batch
    _fails(capsys, _base(tiny_model_dir, short, tmp_path / "o"), "fewer than one global batch")


# --------------------------------------------------------------------------- memory


def test_host_memory_budget_nothing_fits(capsys, monkeypatch, tmp_path: Path, tiny_model_dir: Path,  # noqa: F811
                                         data_file: Path) -> None:  # noqa: F811
    monkeypatch.setattr(budget, "host_available", lambda: 64 * 1024)
    _fails(capsys, _base(tiny_model_dir, data_file, tmp_path / "o"), "host memory", "needs", "available")


def test_device_memory_budget_nothing_fits(capsys, monkeypatch, tmp_path: Path, tiny_model_dir: Path,  # noqa: F811
                                           data_file: Path) -> None:  # noqa: F811
    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity "
                                     "of 23.6 GiB of which 1.2 GiB is free.\nOf the allocated memory ...")

    monkeypatch.setattr(build_module, "DevicePool", no_room)
    _fails(capsys, _base(tiny_model_dir, data_file, tmp_path / "o"), "device cpu: out of memory", "tinypipe plan")


def test_plan_with_nothing_fitting_is_one_line(capsys, tiny_model_dir: Path) -> None:  # noqa: F811
    code, _, err = run_cli(capsys, "plan", "--model", tiny_model_dir, "--gpus", "1", "--gpu-memory", "1KiB",
                           "--cpu-memory", "1KiB", "--seq-len", "16", "--global-batch", "4")
    assert code == 1, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("tinypipe plan:") and "needs" in lines[0] and "Traceback" not in err


# --------------------------------------------------------------------------- output and disk


def test_unwritable_output(capsys, tmp_path: Path, tiny_model_dir: Path, data_file: Path) -> None:  # noqa: F811
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    _fails(capsys, _base(tiny_model_dir, data_file, a_file), "exists and is not a directory")
    _fails(capsys, _base(tiny_model_dir, data_file, a_file / "sub"), "cannot create")
    if os.geteuid() == 0:  # permissions do not stop root: a directory of a read-only file system does
        target = Path("/proc/self")
        if not target.is_dir():
            pytest.skip("no /proc")
    else:
        target = tmp_path / "read_only"
        target.mkdir()
        target.chmod(0o500)
    _fails(capsys, _base(tiny_model_dir, data_file, target), "not writable")


def test_disk_full_while_writing_a_checkpoint_keeps_the_previous_one(capsys, monkeypatch, tmp_path: Path,
                                                                    tiny_model_dir: Path,  # noqa: F811
                                                                    data_file: Path) -> None:  # noqa: F811
    saves = {"n": 0}

    def disk_full_on_second_save(phase: str) -> None:
        if phase == "written":
            saves["n"] += 1
        if phase == "layer" and saves["n"] == 1:  # inside the second save, after its first layer file
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_module, "FAULT_HOOK", disk_full_on_second_save)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the unsaved model is rescued to
    out = tmp_path / "o"
    _fails(capsys, _base(tiny_model_dir, data_file, out, "--checkpoint-every", "1"),
           "disk full", "checkpoint", "intact")
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["extra"]["step"] == 1
    assert not (out / "checkpoint.tmp").exists()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    monkeypatch.setattr(ckpt_module, "FAULT_HOOK", None)  # space freed: --resume finishes the run
    code, stdout, err = run_cli(capsys, *_base(tiny_model_dir, data_file, out, "--checkpoint-every", "1", "--resume"))
    assert code == 0 and "resuming at step 1" in stdout, err


def test_disk_full_while_saving_the_model_keeps_the_previous_output(capsys, monkeypatch, tmp_path: Path,
                                                                   tiny_model_dir: Path,  # noqa: F811
                                                                   data_file: Path) -> None:  # noqa: F811
    import tinypipe.models.export as export

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the unsaved model is rescued to
    out = tmp_path / "o"
    code, _, err = run_cli(capsys, *_base(tiny_model_dir, data_file, out, "--checkpoint-every", "3"))
    assert code == 0, err
    before = (out / "model.safetensors").read_bytes()
    real = export.save_file

    def disk_full(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as f:  # a partial file, then the error
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export, "save_file", disk_full)
    _fails(capsys, _base(tiny_model_dir, data_file, out, "--steps", "6", "--lr", "1e-2", "--checkpoint-every", "3",
                           "--overwrite"),
           "cannot save the model", "disk full")
    assert (out / "model.safetensors").read_bytes() == before  # the previous output survives
    assert not list(out.glob("*.tmp"))
    assert json.loads((out / "checkpoint" / "state.json").read_text())["extra"]["step"] == 6  # and the new state
    monkeypatch.setattr(export, "save_file", real)


# --------------------------------------------------------------------------- devices


def test_device_names(capsys, monkeypatch, tmp_path: Path, tiny_model_dir: Path, data_file: Path) -> None:  # noqa: F811
    """(tpu:0: test_cli.py.) Unknown names in a list; cuda:0 on a machine without CUDA; a CUDA
    index the machine does not have."""
    base = _base(tiny_model_dir, data_file, tmp_path / "o")[:-3]  # without --devices cpu
    _fails(capsys, [*base, "--devices", "cpu,banana", "--no-progress"], "banana")
    _fails(capsys, [*base, "--devices", "gpu0", "--no-progress"], "gpu0")
    if not torch.cuda.is_available():
        _fails(capsys, [*base, "--devices", "cuda:0", "--no-progress"], "cuda:0", "CUDA is not available")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _fails(capsys, [*base, "--devices", "cuda:0,cuda:7", "--no-progress"], "cuda:7", "does not exist")
