"""Issue #34, checksums of sharded checkpoints, through ``torchrun --nproc-per-node 2 -m tinypipe.cli
finetune --optimizer-sharding shard``: each rank's shard files are recorded (sha256) in the
manifest; ``--resume`` continues a sharded checkpoint (it used to stop at "no checkpoint here (no
state.json)": the CLI read only state.json); a flipped byte in one rank's shard -- the file still
parses, its numbers are wrong -- is refused on every rank with the same line naming that file,
before anything trains on it."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from _data_helpers import CORPUS, write_jsonl
from _dist_worker import free_port
from test_cli import tiny_model_dir  # noqa: F401 - the fixture

REPO = Path(__file__).resolve().parents[1]


def _torchrun(logs: Path, *argv: object) -> tuple[int, list[str]]:
    """Run two ranks of ``tinypipe ARGV``; the exit status and each rank's stdout + stderr."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "--log-dir", str(logs), "-r", "3", "-m", "tinypipe.cli",
           *map(str, argv)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=300)
    out = [next(logs.rglob(f"attempt_0/{r}/stdout.log")).read_text()
           + next(logs.rglob(f"attempt_0/{r}/stderr.log")).read_text() for r in range(2)]
    return proc.returncode, out


def _flip_a_data_byte(path: Path) -> None:
    """Change one byte of the first tensor's data (after the safetensors header): still loadable."""
    raw = bytearray(path.read_bytes())
    header = struct.unpack("<Q", raw[:8])[0]
    raw[8 + header + 5] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    return write_jsonl(root / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])


def test_sharded_checkpoints_resume_and_a_damaged_shard_is_refused(tmp_path, tiny_model_dir, data) -> None:  # type: ignore
    out = tmp_path / "out"

    def finetune(logs: str, steps: int, *extra: str) -> tuple[int, list[str]]:
        return _torchrun(tmp_path / logs, "finetune", "--model", tiny_model_dir, "--data", data, "--output", out,
                         "--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--devices", "cpu",
                         "--no-progress", "--steps", steps, "--checkpoint-every", "1", "--optimizer-sharding",
                         "shard", *extra)

    code, logs = finetune("save", 2)
    assert code == 0, logs
    code, logs = finetune("resume", 3, "--resume", "--force")  # --force: 3 steps now, 2 then
    assert code == 0 and "resuming at step 2" in logs[0], logs
    ckpt = out / "checkpoint"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["extra"]["step"] == 3
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.glob("rank-*/*.safetensors"))
    assert len(files) == 2 * len(manifest["layers"])
    assert sorted(manifest.get("sha256", {})) == files  # every rank's every file recorded

    victim = ckpt / "rank-00001-of-00002" / "layer-0001.safetensors"
    _flip_a_data_byte(victim)
    code, logs = finetune("damaged", 3, "--resume")  # the same command as the run that saved it
    assert code != 0
    for rank, log in enumerate(logs):
        lines = [line for line in log.splitlines() if line.startswith("tinypipe:")]
        assert len(lines) == 1 and "Traceback" not in log, f"rank {rank}:\n{log[-3000:]}"
        assert lines[0].startswith(f"tinypipe: error: {victim}: checksum mismatch"), lines[0]
        assert "manifest.json records" in lines[0], lines[0]
    assert json.loads((ckpt / "manifest.json").read_text())["extra"]["step"] == 3  # nothing trained
