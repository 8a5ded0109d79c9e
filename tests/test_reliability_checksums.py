"""Issue #34, item 4: each checkpoint file's sha256 is recorded in ``state.json`` and verified on load:
flipped bytes in a layer file, or a layer file of another shape, stop the resume with one line
naming the file (never trained on, never a traceback)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from _data_helpers import CORPUS, write_jsonl
from test_cli import assert_one_line_error, run_cli, tiny_model_dir  # noqa: F401 - the fixture
from tinypipe.runtime.checksums import sha256_file

COMMON = ["--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--lr", "1e-3", "--devices", "cpu",
          "--no-progress", "--steps", "3", "--checkpoint-every", "1"]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[list, Path]:  # noqa: F811
    """A 3-step run with its checkpoint (the argv to resume it, the output directory)."""
    root = tmp_path_factory.mktemp("sums")
    data = write_jsonl(root / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    out = root / "run"
    argv = ["finetune", "--model", tiny_model_dir, "--data", data, "--output", out, *COMMON]

    class Quiet:
        def readouterr(self):  # type: ignore[no-untyped-def]
            class Out:
                out = err = ""
            return Out()

    assert run_cli(Quiet(), *argv)[0] == 0  # resuming it reloads the checkpoint (of step 3)
    return argv, out


def _copy(out: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(out, dst)
    return dst


def _resume(capsys, argv: list, out: Path):  # type: ignore[no-untyped-def]
    argv = [out if a == argv[argv.index("--output") + 1] else a for a in argv]
    return run_cli(capsys, *argv, "--resume")


def test_state_json_records_a_sha256_per_file(interrupted) -> None:  # type: ignore[no-untyped-def]
    _, out = interrupted
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    for entry in state["layers"]:
        assert entry["sha256"] == sha256_file(out / "checkpoint" / entry["file"])


def test_flipped_bytes_are_refused(capsys, interrupted, tmp_path) -> None:  # type: ignore[no-untyped-def]
    argv, out = interrupted
    target = _copy(out, tmp_path)
    victim = target / "checkpoint" / "layer-0001.safetensors"
    raw = bytearray(victim.read_bytes())
    for k in range(40):  # 40 bytes in the tensor data, past the header: still a loadable file
        raw[-1 - 7 * k] ^= 0x5A
    victim.write_bytes(bytes(raw))
    load_file(str(victim))
    code, _, err = _resume(capsys, argv, target)
    assert code == 2
    assert_one_line_error(err, str(victim), "checksum mismatch")


def test_a_layer_file_of_another_shape_is_one_line(capsys, interrupted, tmp_path) -> None:  # type: ignore
    argv, out = interrupted
    target = _copy(out, tmp_path)
    victim = target / "checkpoint" / "layer-0001.safetensors"
    tensors = load_file(str(victim))
    save_file({k: v[:-3].clone() for k, v in tensors.items()}, str(victim))
    state_path = target / "checkpoint" / "state.json"
    state = json.loads(state_path.read_text())
    for entry in state["layers"]:
        entry.pop("sha256")  # as a checkpoint written before checksums: the shape check still holds
    state_path.write_text(json.dumps(state))
    code, _, err = _resume(capsys, argv, target)
    assert code == 2
    assert_one_line_error(err, str(victim), "elements")
