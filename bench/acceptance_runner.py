"""How the acceptance matrix runs its rows (``bench/acceptance.py``): each row a child process in
a process group of its own, rows that check correctness only (``acceptance.BESIDE``) at the same
time as their host row, every child stopped with all it started when it outruns its limit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


def groups(names: list[str], beside: dict[str, str]) -> list[list[str]]:
    """The selected rows in the order they run, a row of ``beside`` (row -> the row it runs beside)
    in one group with its host (when the host is selected too; else on its own, where it stands)."""
    out = []
    for name in names:
        if beside.get(name) in names:
            continue  # runs in its host's group
        out.append([name, *(n for n in names if beside.get(n) == name)])
    return out


def run_group(group: list[str], rows: dict[str, Any], command: Callable[[str], list[str]], out: Path,
              left: float | None, commit: str) -> dict[str, dict[str, Any]]:
    """Each row of ``group`` (``rows[name]``: its ``seconds`` and ``kind``) as ``command(name)``, a
    child process of its own that writes ``out/<name>.json``, all at once; their records (an error
    record where a child failed or outran its limit: ``left`` seconds + 30, or twice its estimate
    + 120), each with its own ``wall_s``."""
    print(f"== {' + '.join(group)} (~{max(rows[n].seconds for n in group)} s)", flush=True)
    children = {}
    for name in group:
        log = tempfile.TemporaryFile(mode="w+")
        limit = rows[name].seconds * 2 + 120 if left is None else max(30, int(left) + 30)
        children[name] = (launch(command(name), log), log, time.perf_counter(), limit)
    ended: dict[str, tuple[int, float, str]] = {}  # name -> (exit code, wall seconds, why killed)
    while len(ended) < len(children):
        for name, (proc, _, t0, limit) in children.items():
            if name in ended:
                continue
            wall = time.perf_counter() - t0
            if proc.poll() is not None:
                ended[name] = (proc.returncode, wall, "")
            elif wall > limit:
                ended[name] = (kill_group(proc), wall, f"timed out after {limit} s\n")
        time.sleep(0.2)
    records = {}
    for name, (proc, log, _, _) in children.items():
        rc, wall, timed_out = ended[name]
        log.seek(0)
        text = timed_out + log.read()
        log.close()
        path = out / f"{name}.json"
        if rc == 0 and not timed_out and path.exists():
            rec = json.loads(path.read_text())
        else:
            tail = [line for line in text.splitlines() if line.strip()][-3:]
            rec = {"kind": rows[name].kind, "commit": commit, "error": f"exit {rc}: " + " | ".join(tail)[-600:],
                   "log_tail": text[-6000:]}
        rec["wall_s"] = wall
        if len(group) > 1:
            rec["beside"] = [n for n in group if n != name]  # ran at the same time (BESIDE)
        path.write_text(json.dumps(rec, indent=1, default=str))
        records[name] = rec
    return records


def launch(cmd: list[str], log: Any) -> subprocess.Popen:
    """``cmd`` in a process group of its own (in this session: the device call's end still ends it),
    so that a row that outruns its limit is stopped with everything it started -- pytest's workers,
    the CLI row's training runs -- and nothing of it runs on beside the rows after it."""
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, process_group=0)


def kill_group(proc: subprocess.Popen) -> int:
    """SIGKILL ``proc``'s process group (:func:`launch`); its exit code."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # ended meanwhile
        pass
    return proc.wait()
