"""``--report-to tensorboard``: the metrics records as scalars in a real TensorBoard event file
(torch.utils.tensorboard's SummaryWriter), read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

from pathlib import Path

import pytest

from _data_helpers import CORPUS, write_jsonl
from test_cli import run_cli, tiny_model_dir  # noqa: F401 - the fixture
from tinypipe.train.loop import read_metrics
from tinypipe.train.tensorboard import TAGS, TensorBoardReporter

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_finetune_logs_every_metric_and_the_eval_loss(capsys, tiny_model_dir,  # type: ignore # noqa: F811
                                                      tmp_path) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "finetune", "--model", tiny_model_dir, "--data", data,
                                "--output", out, "--seq-len", "16", "--global-batch", "4",
                                "--micro-batch", "2", "--steps", "4",
                                "--devices", "cpu", "--eval-split", "0.2", "--eval-every", "2",
                                "--max-grad-norm", "1.0", "--report-to", "tensorboard", "--no-progress")
    assert code == 0, err
    assert f"tensorboard: logging to {out / 'runs'}" in stdout
    records = read_metrics(out / "metrics.jsonl")
    scalars = _scalars(out / "runs")
    for field in ("loss", "lr", "grad_norm", "tokens_per_s", "seconds", "h2d_gbs", "d2h_gbs", "rss_bytes",
                  "gpu_peak_allocated", "gpu_peak_reserved"):
        got = scalars[TAGS[field]]
        assert [s for s, _ in got] == [1, 2, 3, 4], field
        for (_, value), r in zip(got, records):
            assert value == pytest.approx(float(r[field]), rel=1e-6), field  # float32 in the event file
    held = scalars[TAGS["eval_loss"]]
    assert [s for s, _ in held] == [2, 4]
    assert [v for _, v in held] == pytest.approx([r["eval_loss"] for r in records if "eval_loss" in r],
                                                 rel=1e-6)
    assert [s for s, _ in scalars[TAGS["eval_perplexity"]]] == [2, 4]


def test_a_resumed_run_purges_the_steps_it_redoes(tmp_path) -> None:  # type: ignore
    log = tmp_path / "runs"
    first = TensorBoardReporter(log)
    for step in (1, 2, 3):
        first.write({"step": step, "loss": float(step)})
    first.close()
    resumed = TensorBoardReporter(log, start_step=2)  # the checkpoint was at step 2: step 3 is redone
    for step in (3, 4):
        resumed.write({"step": step, "loss": 10.0 + step})
    resumed.close()
    assert _scalars(log)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]


def test_ssd_rates_are_logged_when_the_records_have_them(tmp_path) -> None:  # type: ignore
    """With the SSD tier the records carry its GB/s (tinypipe.train.loop); they become scalars."""
    log = tmp_path / "runs"
    reporter = TensorBoardReporter(log)
    reporter.write({"step": 1, "loss": 2.0, "ssd_read_gbs": 1.5, "ssd_write_gbs": 0.75})
    reporter.write({"step": 2, "loss": 1.5})  # a record without them (no tier): nothing logged
    reporter.close()
    scalars = _scalars(log)
    assert scalars["perf/ssd_read_GBps"] == [(1, 1.5)] and scalars["perf/ssd_write_GBps"] == [(1, 0.75)]
    assert scalars["train/loss"] == [(1, 2.0), (2, 1.5)]
