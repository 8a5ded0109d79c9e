"""Faults between replicas: a rank killed (SIGKILL) or hung (SIGSTOP: alive, silent) mid-training
ends the others within 60 s with one ``tinypipe:`` line naming it (the heartbeat watchdog; a
collective's error alone would name only a socket); ranks started with different configs or
models, or a global batch that does not divide, are refused on every rank with one line."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from _dist_run import finish, launch

BASE = dict(family="llama", batch=4, steps=3, heartbeat=8.0,
            cfg=dict(pack_size=1, micro_batch_size=2, optimizer_sharding="shard"))


@pytest.mark.parametrize("fault,victim", [("kill", 1), ("hang", 1), ("kill", 0)])
def test_dead_or_hung_rank_ends_the_others(fault: str, victim: int, tmp_path: Path) -> None:
    world = 3 if victim == 0 else 2
    spec = dict(BASE, batch=2 * world, fault=fault, fault_rank=victim, fault_step=1)
    procs, outs = launch(spec, world, tmp_path)
    ready = Path(str(outs[victim]) + ".ready")
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert time.monotonic() < deadline and procs[victim].poll() in (None, -9), finish(procs, 1)
        time.sleep(0.2)
    t0 = time.monotonic()
    others = [p for r, p in enumerate(procs) if r != victim]
    logs = finish(others, 90)
    took = time.monotonic() - t0
    if procs[victim].poll() is None:  # the stopped one
        os.kill(procs[victim].pid, signal.SIGKILL)
    procs[victim].wait()
    assert took <= 60, f"the others took {took:.0f} s to stop"
    for p, log in zip(others, logs):
        assert p.returncode not in (0, None), log[-2000:]
        lines = [line for line in log.splitlines() if line.startswith("tinypipe: rank")]
        assert len(lines) == 1, log[-3000:]
        assert f"rank {victim}" in lines[0], lines[0]


def _refused(spec: dict, world: int, tmp: Path) -> list[str]:
    procs, outs = launch(spec, world, tmp)
    finish(procs, 120)
    assert all(p.returncode != 0 for p in procs)
    return [Path(str(o) + ".err").read_text().splitlines()[0] for o in outs]


def test_mismatched_configs_are_refused_on_every_rank(tmp_path: Path) -> None:
    spec = dict(BASE, steps=1, cfg_of={1: {"max_grad_norm": 2.0}})
    for line in _refused(spec, 2, tmp_path):
        assert line == ("ConfigError: replicas disagree on config.max_grad_norm: rank 0 has None, rank 1 has "
                        "2.0; start every rank with the same command and model"), line


def test_mismatched_models_are_refused_on_every_rank(tmp_path: Path) -> None:
    spec = dict(BASE, steps=1, seed_of={1: 1})
    for line in _refused(spec, 2, tmp_path):
        assert line.startswith("ConfigError: replicas disagree on initial weights checksum: rank 0 "
                               "has "), line


def test_global_batch_that_does_not_divide_is_refused(tmp_path: Path) -> None:
    spec = dict(BASE, batch=5, steps=1)
    for line in _refused(spec, 2, tmp_path):
        assert line == ("BatchError: global batch of 5 sequences does not divide over 2 replicas: use a "
                        "multiple of 2 (4 or 6)"), line
