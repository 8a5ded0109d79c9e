"""``torchrun --nproc-per-node 2 -m tinypipe.cli finetune ...`` on the CPU (gloo): two replicas
train the global batch and end with the weights one process gets from the same command (to float
rounding); only rank 0 prints, writes the metrics and the plots, and saves the model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _data_helpers import CORPUS, write_jsonl
from _dist_worker import free_port
from test_cli import tiny_model_dir  # noqa: F401 - the fixture

REPO = Path(__file__).resolve().parents[1]


def _finetune(model: Path, data: Path, out: Path, procs: int) -> subprocess.CompletedProcess:
    args = ["finetune", "--model", str(model), "--data", str(data), "--output", str(out), "--steps", "3",
            "--global-batch", "4", "--micro-batch", "2", "--seq-len", "16", "--devices", "cpu",
            "--max-grad-norm", "0.5", "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if procs == 1:
        cmd = [sys.executable, "-m", "tinypipe.cli", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "tinypipe.cli", *args]
    return subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=300)


def test_torchrun_finetune_equals_one_process(tmp_path: Path, tiny_model_dir: Path) -> None:  # noqa: F811
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    one = _finetune(tiny_model_dir, data, tmp_path / "one", 1)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _finetune(tiny_model_dir, data, tmp_path / "two", 2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("training: 3 steps") == 1, two.stdout  # rank 0 alone reports
    assert two.stdout.count("saved: model") == 1, two.stdout
    lines = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and '"tokens": 64' in lines[0]  # the global batch's tokens, once
    assert (tmp_path / "two" / "loss.png").is_file()
    a = load_file(str(next((tmp_path / "one").glob("*.safetensors"))))
    b = load_file(str(next((tmp_path / "two").glob("*.safetensors"))))
    assert set(a) == set(b)
    init = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    for k in a:
        moved = float((a[k] - init[k]).norm())
        if moved:
            assert float((a[k] - b[k]).norm()) <= 1e-4 * moved, k
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7)
