"""Issue #34: ``tinypipe demo --output`` is guarded like ``finetune``'s. A directory holding a tinypipe
checkpoint or a saved model is refused in one line naming ``--overwrite`` (the demo has no
``--resume``), before the model loads and with nothing touched; a directory another run holds is
refused too; ``--overwrite`` lets the demo through. Finding the demo's model raises :class:`Reached`
here (a stub): the guard must refuse before it; nothing slow runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tinypipe.train.demo_model as demo_model
from test_cli import assert_one_line_error, run_cli
from tinypipe.cli.output_lock import output_lock


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".tinypipe.lock"}


class Reached(Exception):
    """The demo went past its output checks (it looked for its model)."""


@pytest.fixture(autouse=True)
def _no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def stop() -> Path:
        raise Reached

    monkeypatch.setattr(demo_model, "smollm2_path", stop)


def _with_checkpoint(out: Path) -> None:
    (out / "checkpoint").mkdir(parents=True)
    state = {"format": 1, "step_count": 5, "layers": [], "extra": {"step": 5}}
    (out / "checkpoint" / "state.json").write_text(json.dumps(state))
    (out / "metrics.jsonl").write_text('{"step": 5, "loss": 2.0}\n')


def test_demo_into_a_checkpoint_is_refused(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    _with_checkpoint(out)
    before = _snapshot(out)
    code, _, err = run_cli(capsys, "demo", "--device", "cpu", "--output", out, "--no-progress")
    assert code == 2
    line = assert_one_line_error(err, "holds the checkpoint of a run (step 5)", "--overwrite")
    assert "--resume" not in line  # the demo cannot resume
    assert _snapshot(out) == before


def test_demo_into_a_saved_model_is_refused(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"earlier run")
    code, _, err = run_cli(capsys, "demo", "--device", "cpu", "--output", out, "--no-progress")
    assert code == 2
    assert_one_line_error(err, "model.safetensors", "--overwrite")
    assert (out / "model.safetensors").read_bytes() == b"earlier run"
    with pytest.raises(Reached):
        run_cli(capsys, "demo", "--device", "cpu", "--output", out, "--no-progress", "--overwrite")


def test_demo_into_a_busy_output_is_refused(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    out.mkdir()
    with output_lock(out):  # another run's lock (flock: another open file conflicts, same process too)
        code, _, err = run_cli(capsys, "demo", "--device", "cpu", "--output", out, "--no-progress")
    assert code == 2
    assert_one_line_error(err, "in use by another tinypipe run")
