"""Issue #34, path safety: a checkpoint's ``state.json`` and a model index's ``weight_map`` name files
inside their directory; an absolute or ``../`` name (a read outside it) is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _data_helpers import CORPUS, write_jsonl
from test_cli import assert_one_line_error, run_cli, tiny_model_dir  # noqa: F401 - the fixture
from tinypipe.errors import ConfigError
from tinypipe.safe_paths import inside

COMMON = ["--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--lr", "1e-3", "--devices", "cpu",
          "--no-progress", "--steps", "1", "--checkpoint-every", "1"]


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.safetensors", "a/../../b", "C:\\x", ""])
def test_names_outside_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="not inside"):
        inside(tmp_path, name, tmp_path / "state.json")
    assert inside(tmp_path, "layer-0001.safetensors", tmp_path / "state.json") == tmp_path / "layer-0001.safetensors"


def test_state_json_with_an_outside_file_is_refused(capsys, tmp_path, tiny_model_dir) -> None:  # type: ignore
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    argv = ["finetune", "--model", tiny_model_dir, "--data", data, "--output", tmp_path / "run", *COMMON]
    assert run_cli(capsys, *argv)[0] == 0
    state_path = tmp_path / "run" / "checkpoint" / "state.json"
    state = json.loads(state_path.read_text())
    shutil.copy(state_path.parent / state["layers"][0]["file"], tmp_path / "outside.safetensors")
    state["layers"][0]["file"] = "../../outside.safetensors"
    state_path.write_text(json.dumps(state))
    code, _, err = run_cli(capsys, *argv, "--resume")
    assert code == 2
    assert_one_line_error(err, "outside.safetensors", "not inside")


def test_weight_map_with_an_absolute_file_is_refused(capsys, tmp_path, tiny_model_dir) -> None:  # type: ignore
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    elsewhere = tmp_path / "elsewhere.safetensors"
    (model / "model.safetensors").rename(elsewhere)
    header = json.loads(elsewhere.read_bytes()[8:8 + int.from_bytes(elsewhere.read_bytes()[:8], "little")])
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: str(elsewhere) for k in header if k != "__metadata__"}}))
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    code, _, err = run_cli(capsys, "finetune", "--model", model, "--data", data, "--output", tmp_path / "o",
                           *COMMON)
    assert code == 2
    assert_one_line_error(err, "model.safetensors.index.json", "not inside")
