"""Issue #34, item 1: a run never destroys a checkpoint or model it finds. A fresh run into an output
holding a tinypipe checkpoint or saved model is refused in one line (``--resume`` / ``--overwrite``);
a ``checkpoint`` directory tinypipe did not write is never rotated away; ``--output`` equal to
``--model`` is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _data_helpers import CORPUS, write_jsonl
from test_cli import assert_one_line_error, run_cli, tiny_model_dir  # noqa: F401 - the fixture
from tinypipe.errors import ConfigError
from tinypipe.runtime.checkpoint import swap_in

COMMON = ["--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--lr", "1e-3", "--devices", "cpu",
          "--no-progress", "--steps", "2"]


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes (but the run's lock file, which a refused run may have created)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".tinypipe.lock"}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("guard")
    return write_jsonl(root / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])


def _run(capsys, model: Path, data: Path, out: Path, *extra: object):  # type: ignore[no-untyped-def]
    return run_cli(capsys, "finetune", "--model", model, "--data", data, "--output", out, *COMMON, *extra)


def test_fresh_run_over_a_checkpoint_is_refused(capsys, tiny_model_dir, data, tmp_path) -> None:  # type: ignore
    out = tmp_path / "run"
    code, _, err = _run(capsys, tiny_model_dir, data, out, "--checkpoint-every", "1")
    assert code == 0, err
    before = _snapshot(out)
    code, _, err = _run(capsys, tiny_model_dir, data, out, "--checkpoint-every", "1")
    assert code == 2
    assert_one_line_error(err, "checkpoint", "step 2", "--resume", "--overwrite")
    assert _snapshot(out) == before  # nothing touched
    code, _, err = _run(capsys, tiny_model_dir, data, out, "--checkpoint-every", "1", "--overwrite")
    assert code == 0, err


def test_fresh_run_over_a_saved_model_is_refused(capsys, tiny_model_dir, data, tmp_path) -> None:  # type: ignore
    out = tmp_path / "run"
    (out).mkdir()
    (out / "model.safetensors").write_bytes(b"earlier run")
    code, _, err = _run(capsys, tiny_model_dir, data, out)
    assert code == 2
    assert_one_line_error(err, "model.safetensors", "--overwrite")
    assert (out / "model.safetensors").read_bytes() == b"earlier run"


def test_a_foreign_checkpoint_directory_is_never_deleted(capsys, tiny_model_dir, data, tmp_path) -> None:  # type: ignore
    out = tmp_path / "run"
    foreign = out / "checkpoint"
    foreign.mkdir(parents=True)
    (foreign / "trainer_state.json").write_text(json.dumps({"global_step": 500}))
    (foreign / "optimizer.pt").write_bytes(b"\0" * 100)
    before = _snapshot(out)
    for extra in ((), ("--overwrite",)):
        code, _, err = _run(capsys, tiny_model_dir, data, out, "--checkpoint-every", "1", *extra)
        assert code == 2
        assert_one_line_error(err, str(foreign), "not written by tinypipe")
        assert _snapshot(out) == before


def test_the_checkpoint_swap_refuses_a_foreign_directory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The root: the rotation itself never moves or deletes a directory tinypipe did not write."""
    final, tmp = tmp_path / "checkpoint", tmp_path / "checkpoint.tmp"
    final.mkdir()
    (final / "optimizer.pt").write_bytes(b"theirs")
    tmp.mkdir()
    (tmp / "state.json").write_text(json.dumps({"format": 1, "layers": []}))
    with pytest.raises(ConfigError, match="not a tinypipe checkpoint"):
        swap_in(tmp, final)
    assert (final / "optimizer.pt").read_bytes() == b"theirs"


def _checkpoint_dir(path: Path, step: int) -> Path:
    path.mkdir()
    (path / "state.json").write_text(json.dumps({"format": 1, "layers": ["a", "b"], "extra": {"step": step}}))
    for name in ("layer_000.safetensors", "layer_001.safetensors", "optim_000.safetensors"):
        (path / name).write_bytes(b"x" * 64)
    return path


@pytest.mark.parametrize("survive", [0, 1, 2, 3, 4])
def test_a_kill_while_the_old_checkpoint_is_deleted_leaves_it_tinypipes(tmp_path, monkeypatch, survive) -> None:  # type: ignore
    """A SIGKILL part-way through deleting ``checkpoint.old`` after a swap: what is left still
    carries tinypipe's state.json, so ``--resume`` and the next save accept it and the next swap
    deletes it -- rmtree's order had left a marker-less remainder the output guard refused as
    foreign (tests/test_ssd_kill.py, once in CI). ``survive``: deletions done before the kill."""
    from tinypipe.cli.output_guard import check_output
    from tinypipe.runtime import checkpoint as ckpt

    final = _checkpoint_dir(tmp_path / "checkpoint", 2)
    tmp = _checkpoint_dir(tmp_path / "checkpoint.tmp", 3)
    import os

    real_unlink = os.unlink
    done: list[object] = []

    def killed_after(path, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if len(done) >= survive:
            raise KeyboardInterrupt("killed")  # stands in for the SIGKILL: nothing after it runs
        done.append(path)
        real_unlink(path, *args, **kwargs)

    old = tmp_path / "checkpoint.old"
    _checkpoint_dir(old, 1)  # a previous interrupted save left one
    monkeypatch.setattr(os, "unlink", killed_after)  # what rmtree and Path.unlink call
    with pytest.raises(KeyboardInterrupt):
        ckpt.swap_in(tmp, final)  # deletes the stale .old before moving checkpoint there
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert not ckpt.is_foreign(old) and ckpt.find_checkpoint(final) == final
    assert ckpt.is_tinypipe_checkpoint(old) or not any(old.iterdir())  # at worst an empty directory
    check_output(tmp_path, resume=True, overwrite=False)  # --resume is not refused
    shutil.rmtree(tmp)  # the next save starts by removing an interrupted one's temporary directory
    nxt = _checkpoint_dir(tmp_path / "checkpoint.tmp", 3)
    ckpt.swap_in(nxt, final)
    assert not old.exists() and json.loads((final / "state.json").read_text())["extra"]["step"] == 3


def test_output_equal_to_model_is_refused(capsys, tiny_model_dir, data, tmp_path) -> None:  # type: ignore
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    before = _snapshot(model)
    for extra in ((), ("--overwrite",)):
        code, _, err = _run(capsys, model, data, model, *extra)
        assert code == 2
        assert_one_line_error(err, "is the --model directory")
    assert _snapshot(model) == before
