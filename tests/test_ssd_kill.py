"""SIGKILL with the SSD tier on: the scratch a killed run leaves is found and removed by the next run
(and reported), checkpoints stay the source of truth, and resuming until the end gives the same
losses, gradient norms and final weights as an uninterrupted run -- with the tier and without it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers

from test_cli import data_file, run_cli, tiny_model_dir  # noqa: F401 - fixtures
from test_kill import CHILD, ROOT, STEP_S, _lines, _run_and_kill  # noqa: F401 - the kill harness
from tinypipe.runtime import checkpoint as ckpt_module
from tinypipe.schedule.plan import make_plan
from tinypipe.storage.scratch import PREFIX
from tinypipe.train.loop import read_metrics

STEPS, EVERY = 12, 3


def _args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["finetune", "--model", str(model), "--data", str(data), "--output", str(out), "--seq-len", "16",
            "--global-batch", "4", "--steps", str(STEPS), "--lr", "1e-3", "--warmup-steps", "1",
            "--devices", "cpu", "--checkpoint-every", str(EVERY), "--max-grad-norm", "1.0", "--no-progress",
            *extra]


def _plan_file(tmp_path: Path, offload: bool) -> Path:
    """The tiny model's plan (2 blocks): every layer's master, moments and gradient on the SSD."""
    kinds = ("master", "moments", "grad") if offload else ()
    plan = make_plan(2, pack_size=1, micro_batch_size=2, backward_micro_batch_size=2, num_devices=1,
                     prefetch_window=1, stash="device", tied=False,
                     offload=[(layer, k) for layer in range(4) for k in kinds])
    path = tmp_path / ("plan_ssd.json" if offload else "plan_dram.json")
    plan.save(path)
    return path


def _scratch(ssd: Path) -> list[Path]:
    return sorted(p for p in ssd.iterdir() if p.name.startswith(PREFIX))


@pytest.mark.timeout(300)
def test_sigkill_with_the_tier_on_then_resume_equals_uninterrupted(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path,  # noqa: F811
        data_file: Path) -> None:  # noqa: F811
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    dram_plan, ssd_plan = _plan_file(tmp_path, False), _plan_file(tmp_path, True)
    dram = tmp_path / "dram"
    code, _, err = run_cli(capsys, *_args(tiny_model_dir, data_file, dram, "--plan", dram_plan))
    assert code == 0, err
    straight = tmp_path / "straight"
    code, out, err = run_cli(capsys, *_args(tiny_model_dir, data_file, straight, "--plan", ssd_plan,
                                            "--offload-dir", ssd))
    assert code == 0, err
    assert "offload: moments of 4 layers, grad of 4, master of 4" in out + err and "on SSD" in out + err
    assert not _scratch(ssd), "an uninterrupted run removes its scratch"
    records = read_metrics(straight / "metrics.jsonl")
    assert all(r["ssd_read_bytes"] > 0 and r["ssd_write_bytes"] > 0 for r in records)

    rng = random.Random(11)
    killed = tmp_path / "killed"
    killed.mkdir()
    metrics, log = killed / "metrics.jsonl", tmp_path / "child.log"
    argv = _args(tiny_model_dir, data_file, killed, "--plan", ssd_plan, "--offload-dir", ssd)
    kills = [dict(at_line=rng.randint(EVERY + 1, 2 * EVERY), delay=rng.uniform(0, STEP_S)),
             dict(pause="layer:1"),  # inside a checkpoint write: reads the SSD, writes the checkpoint
             dict(at_line=None, delay=0.0)]
    resumed = False
    for how in kills:
        if how.get("at_line", 0) is None:
            start = _lines(metrics)
            how = dict(at_line=rng.randint(start + 1, min(STEPS - 1, start + EVERY)), delay=rng.uniform(0, STEP_S))
        before = log.read_text() if log.exists() else ""
        assert _run_and_kill(argv + (["--resume"] if resumed else []), killed, log, **how) is None, (
            f"{how}: ended before the kill\n{log.read_text()[-3000:]}")
        if resumed:  # this run found the last one's scratch and said so
            assert "removed SSD scratch left by a killed run" in log.read_text()[len(before):]
        assert len(_scratch(ssd)) == 1, "a killed run leaves its scratch (the next run sweeps it)"
        resumed = ckpt_module.find_checkpoint(killed / "checkpoint") is not None
        assert resumed, f"no checkpoint after {how}"
    code = _run_and_kill(argv + ["--resume"], killed, log)
    assert code == 0, log.read_text()[-3000:]
    assert not _scratch(ssd), "the stale scratch was swept and the last run removed its own"

    for a_dir in (dram, straight):
        a, b = read_metrics(a_dir / "metrics.jsonl"), read_metrics(metrics)
        assert [r["step"] for r in b] == list(range(1, STEPS + 1))
        assert [r["loss"] for r in a] == [r["loss"] for r in b], a_dir
        assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b], a_dir
        wa = transformers.AutoModelForCausalLM.from_pretrained(a_dir, dtype=torch.float32).state_dict()
        wb = transformers.AutoModelForCausalLM.from_pretrained(killed, dtype=torch.float32).state_dict()
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), a_dir
    state = json.loads((killed / "checkpoint" / "state.json").read_text())
    assert state["extra"]["step"] == STEPS
