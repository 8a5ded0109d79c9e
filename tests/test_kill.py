"""SIGKILL at random moments, including inside checkpoint writes: the checkpoint directory is
always loadable, a kill loses at most the steps since the last checkpoint, and resuming until the
end gives the same losses and the same final weights (fp32, exact) as an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from test_cli import data_file, run_cli, tiny_model_dir  # noqa: F401 - fixtures
from tinypipe.runtime import checkpoint as ckpt_module
from tinypipe.runtime import engine as engine_module
from tinypipe.train.loop import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("_kill_child.py")
STEPS, EVERY = 18, 3
STEP_S = 0.06  # about one step of the tiny model on 2 cores


def _args(model: Path, data: Path, out: Path) -> list[str]:
    return ["finetune", "--model", str(model), "--data", str(data), "--output", str(out), "--seq-len", "16",
            "--global-batch", "4", "--micro-batch", "2", "--steps", str(STEPS), "--lr", "1e-3",
            "--warmup-steps", "1", "--devices", "cpu", "--checkpoint-every", str(EVERY),
            "--max-grad-norm", "1.0", "--no-progress"]


def _lines(metrics: Path) -> int:
    return len(read_metrics(metrics)) if metrics.exists() else 0


def _run_and_kill(argv: list[str], out: Path, log: Path, *, at_line: int | None = None, delay: float = 0.0,
                  pause: str | None = None) -> int | None:
    """Start the command; SIGKILL it ``delay`` s after metrics.jsonl has ``at_line`` records, or when
    the checkpoint writer reaches the paused phase. Returns the exit code if it ended by itself."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    marker = out.parent / "paused"
    marker.unlink(missing_ok=True)
    if pause is not None:
        env["TINYPIPE_TEST_PAUSE"] = f"{pause}:{marker}"
    with log.open("a") as f:
        proc = subprocess.Popen([sys.executable, str(CHILD), *argv], env=env, stdout=f, stderr=subprocess.STDOUT)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 60
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if pause is not None and marker.exists():
                break
            if at_line is not None and _lines(metrics) >= at_line:
                time.sleep(delay)
                break
            time.sleep(0.005)
        code = proc.poll()
        if code is not None:
            return code
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        return None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _check_after_kill(ckpt: Path, metrics: Path, states: dict[int, list[dict[str, torch.Tensor]]],
                      expect: str) -> bool:
    """The checkpoint on disk is complete, equals the uninterrupted run's state at its step, and is
    no older than the rules allow; returns whether there is one."""
    done = _lines(metrics)  # steps whose record reached the log (the checkpoint of step s comes after it)
    found = ckpt_module.find_checkpoint(ckpt)
    newest = done - done % EVERY  # the last checkpoint due by now
    if expect == "old":  # killed inside the save of step `done` before the new one was in place
        assert done % EVERY == 0 or done == STEPS
        newest = done - EVERY
    elif expect == "any" and done % EVERY == 0:  # a random kill may have hit that save
        assert found is None or json.loads((found / "state.json").read_text())["extra"]["step"] in (done - EVERY, done)
        newest = None
    if found is None:
        assert newest is None or newest <= 0, f"no checkpoint after {done} steps"
        return False
    state = json.loads((found / "state.json").read_text())
    step = state["extra"]["step"]
    if newest is not None:
        assert step == newest, (step, done, expect)
    assert done - step <= EVERY, "a kill lost more than the steps since the last checkpoint"
    for entry, expected in zip(state["layers"], states[step], strict=True):
        tensors = load_file(str(found / entry["file"]))
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(tensors[key], expected[key]), (step, entry["name"], key)
    return True


@pytest.mark.timeout(240)
def test_sigkill_at_random_points_then_resume_equals_uninterrupted(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        tiny_model_dir: Path, data_file: Path) -> None:  # noqa: F811
    # the uninterrupted run, in this process; remember the state at every checkpoint
    states: dict[int, list[dict[str, torch.Tensor]]] = {}
    real_save = engine_module.Engine.save_checkpoint

    def recording_save(self, path, extra=None):
        self.synchronize()  # the host copy is final (a clipped step's update finishes in the background)
        states[extra["step"]] = [{"master": s.master.clone(), "exp_avg": s.exp_avg.clone(),
                                  "exp_avg_sq": s.exp_avg_sq.clone()} for s in self.store.layers]
        return real_save(self, path, extra)

    monkeypatch.setattr(engine_module.Engine, "save_checkpoint", recording_save)
    straight = tmp_path / "straight"
    code, _, err = run_cli(capsys, *_args(tiny_model_dir, data_file, straight))
    assert code == 0, err
    assert sorted(states) == list(range(EVERY, STEPS + 1, EVERY))

    rng = random.Random(7)
    out = tmp_path / "killed"
    out.mkdir()
    ckpt, metrics, log = out / "checkpoint", out / "metrics.jsonl", tmp_path / "child.log"
    # (how to kill, what the checkpoint must be afterwards); random kills at random moments, and
    # three kills inside a checkpoint write: with some layer files written, between moving the
    # previous checkpoint aside and moving the new one in, and just after the swap
    kills = [
        (dict(at_line=1, delay=rng.uniform(0, STEP_S / 4)), "any"),  # (most likely) before any checkpoint
        (dict(at_line=rng.randint(EVERY + 1, 2 * EVERY), delay=rng.uniform(0, 2 * STEP_S)), "any"),
        (dict(pause="layer:2"), "old"),
        (dict(pause="moved-old:1"), "old"),
        (dict(pause="swapped:1"), "new"),
        (dict(at_line=None, delay=0.0), "any"),  # placeholder: a random line past the resume point
    ]
    has_ckpt = False
    for how, expect in kills:
        argv = _args(tiny_model_dir, data_file, out) + (["--resume"] if has_ckpt else [])
        if "at_line" in how and how["at_line"] is None:
            start = _lines(metrics)
            how = dict(at_line=rng.randint(start + 1, min(STEPS - 1, start + 2 * EVERY)), delay=rng.uniform(0, STEP_S))
        assert _run_and_kill(argv, out, log, **how) is None, f"{how}: the run ended before the kill\n{log.read_text()}"
        has_ckpt = _check_after_kill(ckpt, metrics, states, expect)
        found = ckpt_module.find_checkpoint(ckpt)
        print(f"kill {how}: {_lines(metrics)} steps logged; checkpoint "
              + (f"{found.name} at step {json.loads((found / 'state.json').read_text())['extra']['step']}"
                 if found else "none")
              + f"; leftovers {sorted(p.name for p in out.glob('checkpoint.*'))}")
        if how.get("pause") == "layer:2":  # the kill really landed mid-write: a partial temporary directory
            assert (out / "checkpoint.tmp").is_dir() and not (out / "checkpoint.tmp" / "state.json").exists()
    assert has_ckpt
    code = _run_and_kill(_args(tiny_model_dir, data_file, out) + ["--resume"], out, log)
    assert code == 0, log.read_text()[-3000:]

    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(metrics)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    wa = transformers.AutoModelForCausalLM.from_pretrained(straight, dtype=torch.float32).state_dict()
    wb = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not (out / "checkpoint.old").exists() and not (out / "checkpoint.tmp").exists()
