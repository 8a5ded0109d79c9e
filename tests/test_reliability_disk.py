"""Issue #34, item 3: a full disk (safetensors 0.8 raises a ``SafetensorError``, not an ``OSError``)
stops the run with one line and exit 2; the previous checkpoint survives, no ``checkpoint.tmp`` is
left, and the trained model in memory is saved elsewhere (``TMPDIR``) rather than lost. The disk is
a small tmpfs where the test may mount one, else the error is injected."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import transformers
from safetensors import SafetensorError

from _data_helpers import CORPUS, write_jsonl
from test_cli import assert_one_line_error, run_cli, tiny_model_dir  # noqa: F401 - the fixture
from tinypipe.runtime import checkpoint as ckpt_module
from tinypipe.write_errors import as_os_error, describe

COMMON = ["--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--lr", "1e-3", "--devices", "cpu",
          "--no-progress", "--steps", "3"]
ENOSPC_TEXT = "Error while serializing: I/O error: No space left on device (os error 28)"


@pytest.fixture()
def small_disk(tmp_path: Path) -> Iterator[Path | None]:
    """A 4 MiB tmpfs (None where mounting is not allowed)."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], capture_output=True).returncode == 0
    try:
        yield where if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", str(where)], check=False)


@pytest.fixture()
def rescue_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "tmpdir"
    where.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(where))
    return where


def _fill(disk: Path, leave: int) -> None:
    """Fill ``disk`` up to ``leave`` bytes free."""
    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    (disk / "filler").write_bytes(b"\0" * max(0, free - leave))


def test_disk_full_mid_run_keeps_the_checkpoint_and_the_model(capsys, monkeypatch, tmp_path, small_disk,
                                                              rescue_dir, tiny_model_dir) -> None:  # type: ignore
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    out = (small_disk or tmp_path) / "run"
    saves = []

    def after_first_save(phase: str) -> None:
        if phase == "layer" and len(saves) == 1 and small_disk is None:  # no tmpfs here: inject
            raise SafetensorError(ENOSPC_TEXT)
        if phase == "done":
            saves.append(1)
            if small_disk is not None and len(saves) == 1:
                _fill(small_disk, 64 * 1024)  # room for metrics lines, not for a checkpoint

    monkeypatch.setattr(ckpt_module, "FAULT_HOOK", after_first_save)
    code, _, err = run_cli(capsys, "finetune", "--model", tiny_model_dir, "--data", data, "--output", out,
                           *COMMON, "--checkpoint-every", "1")
    assert code == 2
    line = assert_one_line_error(err, "cannot write checkpoint", "disk full", "intact", "saved to",
                                 "--resume")
    assert json.loads((out / "checkpoint" / "state.json").read_text())["extra"]["step"] == 1
    assert not (out / "checkpoint.tmp").exists()
    (rescued,) = rescue_dir.iterdir()
    assert str(rescued) in line
    transformers.AutoModelForCausalLM.from_pretrained(rescued)  # the trained model, whole


def test_disk_full_in_the_final_save_keeps_the_model(capsys, monkeypatch, tmp_path, rescue_dir,
                                                     tiny_model_dir) -> None:  # type: ignore
    import tinypipe.models.export as export

    data = write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    out = tmp_path / "run"
    real = export.save_file

    def full_once(tensors, filename, *args, **kwargs):  # type: ignore[no-untyped-def]
        if Path(filename).parent == out:
            Path(filename).write_bytes(b"\0" * 100)  # a partial file, then the error
            raise SafetensorError(ENOSPC_TEXT)
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(export, "save_file", full_once)
    code, _, err = run_cli(capsys, "finetune", "--model", tiny_model_dir, "--data", data, "--output", out,
                           *COMMON)
    assert code == 2
    assert_one_line_error(err, "cannot save the model", "disk full", "saved to")
    assert not list(out.glob("*.tmp"))
    (rescued,) = rescue_dir.iterdir()
    transformers.AutoModelForCausalLM.from_pretrained(rescued)


def test_the_file_size_limit_is_one_line() -> None:
    failed = as_os_error(SafetensorError("Error while serializing: I/O error: File too large (os error 27)"))
    assert failed is not None and failed.errno == errno.EFBIG
    assert "ulimit -f" in describe(failed)
