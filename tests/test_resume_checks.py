"""``finetune --resume`` continues only the run that wrote the checkpoint: a changed learning rate,
schedule, step count, data file, model, LoRA setting, held-out split, seed, global batch, precision
or weight-decay grouping stops it with one line naming the difference; ``--force`` overrides and
says so."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from _data_helpers import CORPUS, write_jsonl
from test_cli import assert_one_line_error, run_cli, tiny_model_dir  # noqa: F401 - the fixture
from tinypipe.train.loop import read_metrics

COMMON = ["--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--lr", "1e-3", "--devices", "cpu",
          "--checkpoint-every", "1", "--no-progress"]


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory,
                 tiny_model_dir: Path) -> tuple[Path, Path]:  # noqa: F811
    """A finished 2-step run with its checkpoint: (data file, output directory)."""
    root = tmp_path_factory.mktemp("resume")
    data = write_jsonl(root / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    out = root / "run"
    code = run_cli(_NoCapture(), "finetune", "--model", tiny_model_dir, "--data", data, "--output", out,
                   "--steps", "2", *COMMON)[0]
    assert code == 0
    return data, out


class _NoCapture:
    """Stands in for capsys in a module-scoped fixture (output is not inspected there)."""

    def readouterr(self):  # type: ignore[no-untyped-def]
        class Out:
            out = err = ""
        return Out()


def _resume(capsys, model: Path, data: Path, out: Path, *extra: object):  # type: ignore[no-untyped-def]
    return run_cli(capsys, "finetune", "--model", model, "--data", data, "--output", out, "--steps", "2",
                   *COMMON, "--resume", *extra)


def _copy(out: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(out, dst)
    return dst


def test_the_same_command_resumes(capsys, tiny_model_dir, checkpointed, tmp_path) -> None:  # type: ignore
    data, out = checkpointed
    code, stdout, err = _resume(capsys, tiny_model_dir, data, _copy(out, tmp_path))
    assert code == 0, err
    assert "resuming at step 2" in stdout and "--force" not in stdout


# (changed flags, what the message must name)
CHANGES = {
    "lr": (["--lr", "2e-3"], "lr: 0.001 in the checkpoint, 0.002 now"),
    "schedule": (["--schedule", "linear"], "schedule: cosine in the checkpoint, linear now"),
    "warmup": (["--warmup-steps", "1"], "warmup steps: 0 in the checkpoint, 1 now"),
    "min_lr_ratio": (["--min-lr-ratio", "0.5"], "min lr ratio"),
    "seed": (["--seed", "1"], "seed: 0 in the checkpoint, 1 now"),
    "global_batch": (["--global-batch", "2"], "global batch: 4 in the checkpoint, 2 now"),
    "eval_split": (["--eval-split", "0.1"], "eval split: None in the checkpoint, 0.1 now"),
    "decay_all": (["--decay-all"], "weight-decay grouping"),
    "weight_decay": (["--weight-decay", "0.1"], "weight decay: 0 in the checkpoint, 0.1 now"),
    "max_grad_norm": (["--max-grad-norm", "1.0"], "max grad norm: None in the checkpoint, 1 now"),
    "precision": (["--precision", "bf16"], "precision: fp32 in the checkpoint, bf16 now"),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_changed_setting_is_refused_and_named(name: str, capsys, tiny_model_dir,  # type: ignore
                                                checkpointed, tmp_path) -> None:
    data, out = checkpointed
    flags, needle = CHANGES[name]
    code, _, err = _resume(capsys, tiny_model_dir, data, _copy(out, tmp_path), *flags)
    assert code == 2
    line = assert_one_line_error(err, "other settings than the checkpoint's", needle, "--force")
    assert line.count(" now") == 1, line  # only what changed is named


def test_steps_change_is_refused(capsys, tiny_model_dir, checkpointed, tmp_path) -> None:  # type: ignore
    data, out = checkpointed
    code, _, err = run_cli(capsys, "finetune", "--model", tiny_model_dir, "--data", data, "--output",
                           _copy(out, tmp_path), "--steps", "3", *COMMON, "--resume")
    assert code == 2
    assert_one_line_error(err, "steps: 2 in the checkpoint, 3 now")


def test_changed_data_file_is_refused(capsys, tiny_model_dir, checkpointed, tmp_path) -> None:  # type: ignore
    data, out = checkpointed
    edited = tmp_path / "edited.jsonl"
    edited.write_bytes(data.read_bytes().replace(b"quick", b"quack"))  # same size, other content
    target = _copy(out, tmp_path)
    code, _, err = _resume(capsys, tiny_model_dir, edited, target)
    assert code == 2
    assert_one_line_error(err, "data file:", "data content:")
    same_path = tmp_path / "same"
    same_path.mkdir()
    moved = same_path / data.name
    shutil.copy(data, moved)  # identical content elsewhere: only the path is named
    code, _, err = _resume(capsys, tiny_model_dir, moved, target)
    line = assert_one_line_error(err, "data file:")
    assert "data content" not in line


def test_changed_model_and_lora_are_refused(capsys, tiny_model_dir, checkpointed,  # type: ignore
                                            tmp_path) -> None:
    data, out = checkpointed
    target = _copy(out, tmp_path)
    other = tmp_path / "model_copy"
    shutil.copytree(tiny_model_dir, other)
    code, _, err = _resume(capsys, other, data, target)
    assert code == 2
    assert_one_line_error(err, "model:")
    code, _, err = _resume(capsys, tiny_model_dir, data, target, "--lora")
    assert code == 2
    assert_one_line_error(err, "LoRA")  # another layout: not even --force can load it


def test_lora_setting_change_is_refused(capsys, tiny_model_dir, tmp_path) -> None:  # type: ignore
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    out = tmp_path / "lora"
    args = ["finetune", "--model", tiny_model_dir, "--data", data, "--output", out, "--steps", "2", *COMMON,
            "--lora", "--lora-rank", "2"]
    assert run_cli(capsys, *args)[0] == 0
    code, _, err = run_cli(capsys, *args, "--lora-alpha", "4", "--resume")
    assert code == 2
    assert_one_line_error(err, "lora: rank 2, alpha 16")


def test_force_overrides_and_says_so(capsys, tiny_model_dir, checkpointed, tmp_path) -> None:  # type: ignore
    data, out = checkpointed
    target = _copy(out, tmp_path)
    code, stdout, err = run_cli(capsys, "finetune", "--model", tiny_model_dir, "--data", data, "--output",
                                target, "--steps", "3", *COMMON, "--lr", "2e-3", "--resume", "--force")
    assert code == 0, err
    said = [line for line in stdout.splitlines() if line.startswith("--force:")]
    assert len(said) == 1 and "lr: 0.001 in the checkpoint, 0.002 now" in said[0]
    assert "steps: 2 in the checkpoint, 3 now" in said[0]
    assert [r["step"] for r in read_metrics(target / "metrics.jsonl")] == [1, 2, 3]


def test_force_needs_resume(capsys, tiny_model_dir, checkpointed, tmp_path) -> None:  # type: ignore
    data, _ = checkpointed
    code, _, err = run_cli(capsys, "finetune", "--model", tiny_model_dir, "--data", data, "--output",
                           tmp_path / "x", "--steps", "2", *COMMON, "--force")
    assert code == 2
    assert_one_line_error(err, "--force only applies to --resume")
