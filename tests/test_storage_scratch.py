"""Scratch directories across processes: a live run's files are never touched, a killed run's are
detected, reported in one line and removed, and a run that exits normally leaves nothing behind.

The other runs are real child processes (SIGKILL-ed where the test needs a dead owner).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from tinypipe.storage import ScratchDir, SsdStateStore, sweep_stale
from tinypipe.storage.scratch import NEW_PREFIX, OWNER, PREFIX

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import sys, time
    from tinypipe.devices.host_buffers import aligned_empty
    from tinypipe.storage import SsdStateStore
    store = SsdStateStore(sys.argv[1], {"x": int(sys.argv[3])})
    store.write("x", aligned_empty(int(sys.argv[3]) // 4))
    print(store.path.parent, flush=True)
    if sys.argv[2] == "sleep":
        time.sleep(120)
""")


def store_child(directory: Path, mode: str, nbytes: int = 1 << 20) -> tuple[subprocess.Popen, Path]:
    """A real run in a child process with an SSD store of ``nbytes`` under ``directory``: it
    sleeps (``mode="sleep"``, for the test to SIGKILL) or exits without closing (``"exit"``)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(directory), mode, str(nbytes)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, f"child failed (rc {proc.poll()})"
    return proc, Path(line)


def _scratch(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if p.name.startswith(PREFIX))


def test_live_run_is_untouched_and_killed_run_is_swept(tmp_path, capfd):
    proc, scratch = store_child(tmp_path, "sleep")
    try:
        assert scratch.is_dir() and (scratch / OWNER).exists()
        capfd.readouterr()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a live run: no report, neither a warning nor a line
            assert sweep_stale(tmp_path) == []
            with SsdStateStore(tmp_path, {"y": 4096}):  # a second run next to it
                assert len(_scratch(tmp_path)) == 2
        assert capfd.readouterr().err == ""
        assert _scratch(tmp_path) == [scratch]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert scratch.is_dir(), "SIGKILL runs no cleanup: the files are left behind"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported on stderr, not as a RuntimeWarning
        with ScratchDir(tmp_path) as mine:
            assert _scratch(tmp_path) == [mine.path]
    reports = capfd.readouterr().err.splitlines()
    assert len(reports) == 1  # one line
    assert reports[0].startswith(f"tinypipe: removed SSD scratch left by a killed run: {scratch} "
                                 f"(pid {proc.pid} on ")
    assert "1.0 MiB" in reports[0]
    assert _scratch(tmp_path) == []


def test_sweep_returns_what_it_removed(tmp_path, capfd):
    proc, scratch = store_child(tmp_path, "sleep")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    capfd.readouterr()
    (found,) = sweep_stale(tmp_path)
    assert "tinypipe: removed SSD scratch left by a killed run" in capfd.readouterr().err
    assert found.path == scratch and found.owner["pid"] == proc.pid and found.nbytes >= 1 << 20
    assert not scratch.exists()


def test_normal_exit_removes_the_scratch(tmp_path):
    proc, scratch = store_child(tmp_path, "exit")  # never calls close(): the finalizer does it at exit
    assert proc.wait(60) == 0
    proc.stdout.close()
    assert not scratch.exists() and list(tmp_path.iterdir()) == []


def test_half_created_and_ownerless_leftovers(tmp_path, capfd):
    young = tmp_path / f"{NEW_PREFIX}young"
    young.mkdir()  # a run creating its directory right now: left alone
    old = tmp_path / f"{NEW_PREFIX}old"
    old.mkdir()
    stamp = time.time() - 3600
    os.utime(old, (stamp, stamp))
    ownerless = tmp_path / f"{PREFIX}gone"  # a sweep killed after removing the owner file
    ownerless.mkdir()
    (ownerless / "state-1.bin").write_bytes(b"x" * 10)
    unrelated = tmp_path / "checkpoint-100"
    unrelated.mkdir()
    capfd.readouterr()
    found = sweep_stale(tmp_path)
    assert sorted(f.path.name for f in found) == sorted([old.name, ownerless.name])
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 2 and all(x.startswith("tinypipe: ") and "an unknown run" in x for x in lines)
    assert young.is_dir() and unrelated.is_dir() and not old.exists() and not ownerless.exists()


def test_scratch_file_names_stay_inside(tmp_path):
    with ScratchDir(tmp_path) as scratch:
        assert scratch.file("state.bin") == str(scratch.path / "state.bin")
        for bad in ("../x", OWNER, "", ".."):
            with pytest.raises(ValueError):
                scratch.file(bad)
    assert scratch.closed and list(tmp_path.iterdir()) == []
