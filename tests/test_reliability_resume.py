"""Issue #34, item 2: ``--resume`` refuses to continue a different run: a changed ``--seq-len``, and a
base model replaced at the same path (recorded by a fingerprint of its files, not only its path)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

from _data_helpers import CORPUS, write_jsonl
from test_cli import assert_one_line_error, run_cli, tiny_model_dir  # noqa: F401 - the fixture

COMMON = ["--global-batch", "4", "--micro-batch", "2", "--lr", "1e-3", "--devices", "cpu",
          "--checkpoint-every", "1", "--no-progress", "--steps", "2"]


@pytest.fixture()
def lora_run(tmp_path: Path, tiny_model_dir: Path) -> tuple[list[object], Path]:  # noqa: F811
    """A finished 2-step LoRA run over a copy of the model: (its argv, the model directory)."""
    model = tmp_path / "base"
    shutil.copytree(tiny_model_dir, model)
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    argv: list[object] = ["finetune", "--model", model, "--data", data, "--output", tmp_path / "run", *COMMON,
                          "--lora", "--lora-rank", "2"]
    code, _, err = run_cli(_Quiet(), *argv, "--seq-len", "16")
    assert code == 0, err
    return argv, model


class _Quiet:
    def readouterr(self):  # type: ignore[no-untyped-def]
        class Out:
            out = err = ""
        return Out()


def test_a_changed_seq_len_is_refused(capsys, lora_run) -> None:  # type: ignore[no-untyped-def]
    argv, _ = lora_run
    code, _, err = run_cli(capsys, *argv, "--seq-len", "32", "--resume")
    assert code == 2
    assert_one_line_error(err, "seq len: 16 in the checkpoint, 32 now")


def test_a_base_replaced_at_the_same_path_is_refused(capsys, lora_run) -> None:  # type: ignore
    argv, model = lora_run
    config = transformers.AutoConfig.from_pretrained(model)
    torch.manual_seed(1)  # another model, same architecture, same path
    transformers.LlamaForCausalLM(config).save_pretrained(model)
    code, _, err = run_cli(capsys, *argv, "--seq-len", "16", "--resume")
    assert code == 2
    line = assert_one_line_error(err, "model content:")
    assert "model:" not in line.replace("model content:", "")  # the path is the same
