"""Issue #34, item 5: two runs into one output directory would interleave ``metrics.jsonl`` and crash
one another; the second is refused in one line while the first holds ``OUTPUT/.tinypipe.lock``, and
the lock goes with the process that held it (a killed run leaves none behind)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from _data_helpers import CORPUS, write_jsonl
from test_cli import assert_one_line_error, run_cli, tiny_model_dir  # noqa: F401 - the fixture

COMMON = ["--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--lr", "1e-3", "--devices", "cpu",
          "--no-progress", "--steps", "2"]
HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
print("held", flush=True)
time.sleep(60)
"""


def test_a_second_run_into_a_busy_output_is_refused(capsys, tmp_path, tiny_model_dir) -> None:  # type: ignore
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')  # the running run's lines
    argv = ["finetune", "--model", tiny_model_dir, "--data", data, "--output", out, *COMMON]
    other = subprocess.Popen([sys.executable, "-c", HOLDER, str(out / ".tinypipe.lock")], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "held"
        code, _, err = run_cli(capsys, *argv)
        assert code == 2
        assert_one_line_error(err, "in use by another tinypipe run", f"pid {other.pid}")
        assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'  # untouched
    finally:
        other.kill()
        other.wait()
    time.sleep(0.1)
    code, _, err = run_cli(capsys, *argv)  # the holder died: its lock with it
    assert code == 0, err
