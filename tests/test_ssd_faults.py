"""Faults of the SSD tier: a disk that fills up or fails mid-run stops training with one line and
the previous checkpoint intact (resuming from it finishes the run exactly); too little free space
or a missing directory is refused before anything is allocated; scratch files go away at close, at
garbage collection, at interpreter exit (also after an uncaught exception), and the ones a killed
run leaves are removed -- and reported -- by the next run, never a live run's."""

from __future__ import annotations

import dataclasses
import errno
import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

import tinypipe
from model_zoo import make_batch, make_model
from test_cli import assert_one_line_error, data_file, run_cli, tiny_model_dir  # noqa: F401 - fixtures
from test_ssd_kill import _plan_file, _scratch
from tinypipe.errors import StorageError, WorkerError
from tinypipe.planner.auto import manual_plan
from tinypipe.runtime import engine as engine_module
from tinypipe.storage import direct, scratch, store as store_module
from tinypipe.train.loop import read_metrics

ROOT = Path(__file__).resolve().parents[1]
ALL = ("master", "moments", "grad")


def _engine(ssd: Path, model: torch.nn.Module | None = None, **cfg: object) -> tinypipe.Engine:
    config = tinypipe.Config(pack_size=2, micro_batch_size=2, lr=1e-3, offload_dir=str(ssd), **cfg)
    plan = manual_plan(config, num_blocks=4, tied=False)
    offload = tuple((layer, k) for layer in range(6) for k in ("master", "moments"))
    return tinypipe.Engine(model or make_model("llama"), config, plan=dataclasses.replace(plan, offload=offload))


def _steps_then_fail(monkeypatch: pytest.MonkeyPatch, ok_steps: int, where: str, code: int) -> None:
    """From optimizer step ``ok_steps + 1`` on, every SSD transfer of kind ``where`` fails."""
    calls = {"steps": 0}
    real_step = engine_module.Engine.step

    def counting_step(self, *args, **kwargs):
        calls["steps"] += 1
        return real_step(self, *args, **kwargs)

    real = getattr(direct, where)

    def failing(*args, **kwargs):
        if calls["steps"] > ok_steps:
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module.Engine, "step", counting_step)
    monkeypatch.setattr(store_module, where, failing)


def test_disk_full_mid_run_is_one_line_and_the_checkpoint_survives(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        tiny_model_dir: Path, data_file: Path) -> None:  # noqa: F811
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    plan = _plan_file(tmp_path, True)
    base = ["finetune", "--model", tiny_model_dir, "--data", data_file, "--seq-len", "16", "--global-batch",
            "4", "--steps", "6", "--lr", "1e-3", "--devices", "cpu", "--checkpoint-every", "2",
            "--max-grad-norm", "1.0", "--no-progress", "--plan", plan, "--offload-dir", ssd]
    straight, out = tmp_path / "straight", tmp_path / "out"
    code, _, err = run_cli(capsys, *base, "--output", straight)
    assert code == 0, err
    _steps_then_fail(monkeypatch, 3, "write_from", errno.ENOSPC)  # the 4th step's write-backs fail
    code, _, err = run_cli(capsys, *base, "--output", out)
    assert code == 2
    line = assert_one_line_error(err, "No space left on device (ENOSPC)")
    # the failed write itself, or the read of the region it left invalid (whichever comes first)
    assert "SSD write to" in line or "its last write failed" in line, line
    assert "free on the disk" in line or "disk is full" in line
    assert not _scratch(ssd), "the failed run still removed its scratch"
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    monkeypatch.undo()  # space freed: --resume from the step-2 checkpoint finishes the run exactly
    code, stdout, err = run_cli(capsys, *base, "--output", out, "--resume")
    assert code == 0 and "resuming at step 2" in stdout, err
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(out / "metrics.jsonl")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    wa = transformers.AutoModelForCausalLM.from_pretrained(straight, dtype=torch.float32).state_dict()
    wb = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_read_error_mid_run_stops_the_engine_with_one_line(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    engine.step(make_batch(4, 12))
    _steps_then_fail(monkeypatch, 0, "read_into", errno.EIO)  # from the next step on
    with pytest.raises(WorkerError) as info:
        engine.step(make_batch(4, 12, seed=1))
    text = str(info.value)
    assert "\n" not in text and "SSD read of" in text and "Input/output error (EIO)" in text
    with pytest.raises(WorkerError, match="engine unusable: the SSD tier failed"):
        engine.step(make_batch(4, 12, seed=2))
    assert engine.optimizer.tier.update_pool.free == len(engine.optimizer.tier.update_pool.slots)
    engine.close()
    assert not list(tmp_path.iterdir())


def test_too_little_space_or_no_directory_is_refused_before_allocating(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    model = make_model("llama")
    monkeypatch.setattr(scratch, "free_bytes", lambda parent: 1 << 10)
    with pytest.raises(StorageError, match=r"has 1\.0 KiB free; the SSD tier needs .* choose another"):
        _engine(tmp_path, model)
    assert all(p.device.type == "cpu" for p in model.parameters())  # the model was not touched
    monkeypatch.undo()
    with pytest.raises(StorageError, match="offload directory .*missing does not exist"):
        _engine(tmp_path / "missing", model)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="is not a directory"):
        _engine(tmp_path / "file", model)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_scratch_goes_away_at_close_and_when_the_engine_is_dropped(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    engine.step(make_batch(4, 12))
    (held,) = _scratch(tmp_path)
    assert any(held.iterdir())
    engine.close()
    assert not held.exists()
    engine = _engine(tmp_path)
    engine.step(make_batch(4, 12))
    assert _scratch(tmp_path)
    del engine
    gc.collect()
    assert not _scratch(tmp_path)


_CHILD = textwrap.dedent(
    """
    import dataclasses, os, signal, sys
    sys.path.insert(0, {tests!r})
    import tinypipe
    from model_zoo import make_batch, make_model
    from tinypipe.planner.auto import manual_plan
    cfg = tinypipe.Config(pack_size=2, micro_batch_size=2, offload_dir={ssd!r})
    plan = dataclasses.replace(manual_plan(cfg, num_blocks=4, tied=False), offload=((1, "moments"), (2, "master")))
    engine = tinypipe.Engine(make_model("llama"), cfg, plan=plan)
    engine.step(make_batch(4, 12))
    how = {how!r}
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "raise":
        raise RuntimeError("uncaught")
    """
)


@pytest.mark.parametrize("how", ["exit", "raise", "kill"])
def test_scratch_at_interpreter_exit_and_after_a_kill(tmp_path: Path, how: str,
                                                     capfd: pytest.CaptureFixture) -> None:
    script = _CHILD.format(tests=str(ROOT / "tests"), ssd=str(tmp_path), how=how)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    if how == "kill":
        assert proc.returncode == -signal.SIGKILL
        (left,) = _scratch(tmp_path)  # nobody could clean up: the next run does, and says so
        capfd.readouterr()
        engine = _engine(tmp_path)
        (line,) = [x for x in capfd.readouterr().err.splitlines() if "scratch" in x]  # one line
        assert re.match(r"tinypipe: removed SSD scratch left by a killed run: .*pid", line), line
        assert not left.exists() and [x.path for x in engine.store.offload.swept] == [left]
        engine.close()
    else:
        assert proc.returncode == (1 if how == "raise" else 0), proc.stderr[-2000:]
    assert not _scratch(tmp_path)


def test_a_live_runs_scratch_is_never_swept(tmp_path: Path) -> None:
    first = _engine(tmp_path)
    a = [first.step(make_batch(4, 12, seed=0)).loss]
    second = _engine(tmp_path)  # same directory, while the first one trains
    assert len(_scratch(tmp_path)) == 2 and not second.store.offload.swept
    b = []
    for seed in (1, 2):
        a.append(first.step(make_batch(4, 12, seed=seed)).loss)
        b.append(second.step(make_batch(4, 12, seed=seed - 1)).loss)
    b.append(second.step(make_batch(4, 12, seed=2)).loss)
    ref = tinypipe.Engine(make_model("llama"), tinypipe.Config(pack_size=2, micro_batch_size=2, lr=1e-3))
    assert a == b == [ref.step(make_batch(4, 12, seed=seed)).loss for seed in range(3)]
    for e in (first, second, ref):
        e.close()
    assert not _scratch(tmp_path)
