"""Launch a data-parallel test run: ``world`` subprocess ranks (gloo on the CPU, a free port) of
tests/_dist_worker.py, and read back what each rank wrote."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from _dist_worker import free_port

HERE = Path(__file__).resolve().parent


def launch(spec: dict, world: int, tmp: Path) -> tuple[list[subprocess.Popen], list[Path]]:
    tmp.mkdir(parents=True, exist_ok=True)
    spec_path = tmp / "spec.pt"
    torch.save(spec, spec_path)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]), OMP_NUM_THREADS="1")
    outs = [tmp / f"rank{r}.pt" for r in range(world)]
    # one machine, as torchrun tells its ranks (the planner shares the node's memory among them)
    procs = [subprocess.Popen([sys.executable, str(HERE / "_dist_worker.py"), str(r), str(world), str(port),
                               str(spec_path), str(outs[r])],
                              env=dict(env, LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world)), cwd=str(HERE.parent),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    return procs, outs


def run(spec: dict, world: int, tmp: Path, timeout: float = 240.0) -> list[dict]:
    """Run to the end; every rank's results (AssertionError with the ranks' output on failure)."""
    procs, outs = launch(spec, world, tmp)
    logs = finish(procs, timeout)
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    assert not bad, "\n".join(f"--- rank {r} rc={procs[r].returncode}\n{logs[r][-3000:]}" for r in bad)
    return [torch.load(o, weights_only=False) for o in outs]


def finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for every rank (killing what outlives ``timeout``); their output."""
    deadline = time.monotonic() + timeout
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        logs.append(out or "")
    return logs
