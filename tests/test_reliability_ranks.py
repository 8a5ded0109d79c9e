"""Issue #34: a dead rank of a torchrun job ends the others within 5 s, and SIGTERM -- what torchrun
sends every other rank then -- stops a rank at once, cleanly. Real processes: ``tinypipe finetune``
of a 2-layer Llama on the CPU, two gloo ranks.

- SIGKILL rank 1 of ``torchrun --nproc-per-node 2`` mid-run: rank 0 exits within 5 s with one line
  naming rank 1 and status 75 (its connection to rank 1 reads end-of-file at once; measured ~0.2 s
  here, against 30 s before: rank 0 sat in a collective until torchrun's SIGKILL). 5 s is the
  issue's target and leaves >10x margin on this shared 2-core machine; the checkpoint directory
  holds a complete, verified checkpoint and no ``checkpoint.tmp``.
- SIGTERM to the rank that is writing a checkpoint (paused mid-write by a test hook, so the signal
  lands there for certain): it exits within 5 s (measured ~0.1 s; before, it finished the save and
  waited on its peer) with one line, status 143, no traceback; the half-written ``checkpoint.tmp``
  is removed, the previous checkpoint is intact (checksums verified); its peer stops too (status
  75, one line naming it). Replicated (rank 0 writes) and sharded (rank 1 writes its shard).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from _data_helpers import CORPUS, write_jsonl
from _dist_worker import free_port
from test_cli import tiny_model_dir  # noqa: F401 - the fixture
from tinypipe.runtime.checksums import sha256_file

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
COMMON = ["--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--lr", "1e-5", "--devices", "cpu",
          "--no-progress", "--steps", "100000"]
LAYER_FILES = 4  # a checkpoint of the 2-layer Llama: embedding, 2 blocks, final norm + head
LIMIT_S = 5.0  # the target


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ranks")
    return write_jsonl(root / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]))


def _wait_for(check, what: str, procs: list, timeout: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert all(p.poll() is None for p in procs), f"a process ended while waiting for {what}"
        time.sleep(0.1)


def _metrics_lines(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _tinypipe_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("tinypipe:")]


def _assert_intact(ckpt: Path, step: int | None = None) -> None:
    """A complete checkpoint at ``ckpt`` whose files match their recorded sha256; nothing half-written."""
    assert not ckpt.with_name("checkpoint.tmp").exists(), "a half-written checkpoint.tmp was left"
    assert not ckpt.with_name("checkpoint.old").exists()
    if (ckpt / "manifest.json").exists():
        record = json.loads((ckpt / "manifest.json").read_text())
        sums = record["sha256"]
    else:
        record = json.loads((ckpt / "state.json").read_text())
        sums = {layer["file"]: layer["sha256"] for layer in record["layers"]}
    assert sums and all(sha256_file(ckpt / name) == digest for name, digest in sums.items())
    if step is not None:
        assert record["extra"]["step"] == step, record["extra"]


def test_a_killed_torchrun_rank_ends_the_other_within_5_s(tmp_path, tiny_model_dir, data) -> None:  # type: ignore
    out, logs = tmp_path / "out", tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "--log-dir", str(logs), "-r", "3", "-m", "tinypipe.cli",
           "finetune", "--model", str(tiny_model_dir), "--data", str(data), "--output", str(out), *COMMON,
           "--checkpoint-every", "2"]
    launcher = subprocess.Popen(cmd, env=_env(), cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    try:
        _wait_for(lambda: _metrics_lines(out) >= 5, "training", [launcher])
        ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(launcher.pid).children(recursive=True)
                 if "RANK" in p.environ()}
        t0 = time.monotonic()
        ranks[1].kill()
        gone, _ = psutil.wait_procs([ranks[0]], timeout=40)
        took = time.monotonic() - t0
        report, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert gone and took < LIMIT_S, f"rank 0 took {took:.1f} s to stop after rank 1 was killed"
    assert launcher.returncode != 0
    assert re.search(r"exitcode\s*:\s*75\b", report), report[-3000:]  # rank 0's status, as torchrun saw it
    err = next(logs.rglob("attempt_0/0/stderr.log")).read_text()
    lines = _tinypipe_lines(err)
    assert len(lines) == 1 and lines[0].startswith("tinypipe: rank 1 died"), err[-3000:]
    assert "Traceback" not in err
    _assert_intact(out / "checkpoint")
    print(f"\nrank 0 stopped {took:.2f} s after rank 1 was killed: {lines[0]}")


def _rank(rank: int, port: int, argv: list[str], log: Path, pause: str | None = None) -> subprocess.Popen:
    """One rank as torchrun starts it (its environment), without torchrun: this test signals it."""
    env = dict(_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if pause:
        env["TINYPIPE_TEST_PAUSE"] = pause
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, str(HERE / "_rank_cli.py"), *argv], env=env, cwd=str(REPO),
                                stdout=f, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("sharding,writer", [("replicate", 0), ("shard", 1)])
def test_sigterm_mid_checkpoint_stops_a_rank_at_once(sharding, writer, tmp_path, tiny_model_dir,  # type: ignore
                                                     data) -> None:
    out, ready = tmp_path / "out", tmp_path / "ready"
    argv = ["finetune", "--model", str(tiny_model_dir), "--data", str(data), "--output", str(out), *COMMON,
            "--checkpoint-every", "1", "--optimizer-sharding", sharding]
    port, logs = free_port(), [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    # the writer pauses after the 2nd layer file of the 3rd checkpoint (steps 1 and 2 are saved)
    pause = f"layer:{2 * LAYER_FILES + 2}:{ready}"
    procs = [_rank(r, port, argv, logs[r], pause if r == writer else None) for r in range(2)]
    try:
        _wait_for(ready.exists, "the third checkpoint's write", procs)
        assert (out / "checkpoint.tmp").is_dir()  # half-written now
        t0 = time.monotonic()
        os.kill(procs[writer].pid, signal.SIGTERM)
        codes = {}
        for r in (writer, 1 - writer):
            try:
                codes[r] = procs[r].wait(timeout=LIMIT_S + 10)
            except subprocess.TimeoutExpired:
                codes[r] = None
            codes[f"{r}s"] = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = [log.read_text() for log in logs]
    assert codes[writer] == 143 and codes[f"{writer}s"] < LIMIT_S, (codes, text[writer][-3000:])
    lines = _tinypipe_lines(text[writer])
    assert len(lines) == 1 and "Traceback" not in text[writer], text[writer][-3000:]
    assert lines[0].startswith(f"tinypipe: rank {writer} got SIGTERM in step 3"), lines[0]
    assert f"the checkpoint of step 2 in {out / 'checkpoint'} is intact" in lines[0], lines[0]
    peer = 1 - writer  # told the writer stops: ends after its grace, naming it
    assert codes[peer] == 75 and codes[f"{peer}s"] < LIMIT_S, (codes, text[peer][-3000:])
    peer_lines = _tinypipe_lines(text[peer])
    assert len(peer_lines) == 1 and peer_lines[0].startswith(f"tinypipe: rank {writer} stopped"), text[peer][-3000:]
    _assert_intact(out / "checkpoint", step=2)
    print(f"\n{sharding}: rank {writer} exited {codes[f'{writer}s']:.2f} s after SIGTERM, rank {peer} "
          f"{codes[f'{peer}s']:.2f} s")
