"""Issue #34, the small items: memory messages round to digits that tell need and have apart;
``--checkpoint-every 0`` / ``-1`` are refused; a plan run on CPU does not claim to step anything on a
GPU; ``--skip-bad-lines`` reports each skipped line once."""

from __future__ import annotations

import logging

import pytest

from _data_helpers import CORPUS, write_jsonl
from test_cli import assert_one_line_error, run_cli, tiny_model_dir  # noqa: F401 - the fixture
from tinypipe.units import GIB, gib_pair

COMMON = ["--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--lr", "1e-3", "--devices", "cpu",
          "--no-progress", "--steps", "1"]


def test_need_and_have_differ_in_the_text() -> None:
    assert gib_pair(3.04 * GIB, 2.96 * GIB) == ("3.04 GiB", "2.96 GiB")  # was "3.0 GiB, have 3.0 GiB"
    assert gib_pair(3.0001 * GIB, 3.0 * GIB) == ("3.0001 GiB", "3.0000 GiB")
    assert gib_pair(12.5 * GIB, 8 * GIB) == ("12.5 GiB", "8.0 GiB")


@pytest.mark.parametrize("every", ["0", "-1"])
def test_checkpoint_every_below_one_is_refused(capsys, tmp_path, tiny_model_dir, every) -> None:  # type: ignore
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    code, _, err = run_cli(capsys, "finetune", "--model", tiny_model_dir, "--data", data, "--output",
                           tmp_path / "o", *COMMON, "--checkpoint-every", every)
    assert code == 2
    assert_one_line_error(err, "checkpoint_every must be >= 1", f"got {every}")


def test_a_cpu_plan_says_nothing_of_a_gpu_and_bad_lines_are_logged_once(capsys, caplog, tmp_path,
                                                                          tiny_model_dir) -> None:  # type: ignore
    rows = [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    data.write_text(data.read_text() + "{not json\n")
    with caplog.at_level(logging.WARNING):
        code, out, err = run_cli(capsys, "finetune", "--model", tiny_model_dir, "--data", data, "--output",
                                 tmp_path / "o", *COMMON, "--device-optimizer", "embed", "--skip-bad-lines")
    assert code == 0, err
    (plan,) = [line for line in out.splitlines() if line.startswith("plan: ")]
    assert "GPU" not in plan and "embed stepped on the device (cpu)" in plan
    skipped = [r for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1, [r.getMessage() for r in skipped]
