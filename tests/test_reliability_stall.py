"""Issue #34, item 7: a run the learning rate wrecked (``--lr 1e6``: the loss stuck at ln(vocabulary),
gradient norm 0) stops with one line at the first such step, before that step's checkpoint: the last
checkpoint is still the healthy one and no wrecked model is saved."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from _data_helpers import CORPUS, write_jsonl
from test_cli import assert_one_line_error, run_cli, tiny_model_dir  # noqa: F401 - the fixture
from tinypipe.errors import StalledError
from tinypipe.train.stall import check_progress

COMMON = ["--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--lr", "1e-3", "--devices", "cpu",
          "--no-progress", "--steps", "5", "--checkpoint-every", "1"]


def test_a_wrecked_run_stops_before_its_checkpoint(capsys, monkeypatch, tmp_path,
                                                   tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    import tinypipe.runtime.engine as engine_module

    real = engine_module.Engine.step

    def wrecked_from_step_3(self, batch, lr=None):  # type: ignore[no-untyped-def]
        result = real(self, batch, lr=lr)
        if self.step_count < 3:
            return result
        vocab = self.model.config.vocab_size  # what a wrecked model shows: uniform, nothing moves
        return dataclasses.replace(result, loss=math.log(vocab), grad_norm=0.0)

    monkeypatch.setattr(engine_module.Engine, "step", wrecked_from_step_3)
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "finetune", "--model", tiny_model_dir, "--data", data, "--output", out,
                           *COMMON)
    assert code == 2
    assert_one_line_error(err, "stalled at step 3", "gradient norm 0", "ln of the", "--lr")
    assert json.loads((out / "checkpoint" / "state.json").read_text())["extra"]["step"] == 2
    assert not (out / "model.safetensors").exists()


@pytest.mark.parametrize("loss, norm", [(float("nan"), 1.0), (5.0, float("inf")), (5.0, 0.0)])
def test_non_finite_or_zero_is_stalled(loss: float, norm: float) -> None:
    with pytest.raises(StalledError):
        check_progress({"step": 4, "loss": loss, "grad_norm": norm, "tokens": 64}, 387, 1e6)


def test_healthy_empty_or_skipped_steps_pass() -> None:
    check_progress({"step": 1, "loss": 5.9, "grad_norm": 1.7, "tokens": 64}, 387, 1e-3)
    check_progress({"step": 1, "loss": float("nan"), "grad_norm": 0.0, "tokens": 0}, 387, 1e-3)
    check_progress({"step": 1, "loss": 5.9, "grad_norm": 0.0, "tokens": 64, "skipped": True}, 387, 1e-3)
