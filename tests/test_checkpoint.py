"""Checkpoints: resuming equals an uninterrupted run; an interrupted save loses nothing."""

from __future__ import annotations

import os

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from tinypipe.runtime import checkpoint as ckpt

CFG = dict(devices=["cpu"], pack_size=2, micro_batch_size=2, lr=1e-3, eps=1e-6, weight_decay=0.1, max_grad_norm=1.0)


def batches() -> list[dict]:
    return [make_batch(4, 10, seed=i, pad=i % 2 == 1) for i in range(5)]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_resume_equals_uninterrupted(family: str, tmp_path) -> None:
    data = batches()
    straight = tinypipe.Engine(make_model(family), tinypipe.Config(**CFG))
    losses = [straight.step(b).loss for b in data]

    first = tinypipe.Engine(make_model(family), tinypipe.Config(**CFG))
    for b in data[:3]:
        first.step(b)
    first.save_checkpoint(tmp_path / "ckpt", extra={"data_position": 3})
    del first

    resumed = tinypipe.Engine(make_model(family, seed=123), tinypipe.Config(**CFG))  # other init: overwritten
    extra = resumed.load_checkpoint(tmp_path / "ckpt")
    assert extra == {"data_position": 3} and resumed.step_count == 3
    tail = [resumed.step(b).loss for b in data[3:]]
    assert tail == losses[3:]
    a, b = straight.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_before_any_step(tmp_path) -> None:
    eng = tinypipe.Engine(make_model("llama"), tinypipe.Config(**CFG))
    eng.save_checkpoint(tmp_path / "c0")
    other = tinypipe.Engine(make_model("llama"), tinypipe.Config(**CFG))
    other.load_checkpoint(tmp_path / "c0")
    b = make_batch(4, 10)
    assert eng.step(b).loss == other.step(b).loss


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch) -> None:
    eng = tinypipe.Engine(make_model("llama"), tinypipe.Config(**CFG))
    eng.step(make_batch(4, 10))
    eng.save_checkpoint(tmp_path / "c", extra={"n": 1})
    eng.step(make_batch(4, 10, seed=1))
    calls = {"n": 0}
    real = ckpt.save_file

    def dying(tensors, name, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(tensors, name, *a, **k)

    monkeypatch.setattr(ckpt, "save_file", dying)
    with pytest.raises(ckpt.CheckpointWriteError, match="disk full.*previous checkpoint .* is intact") as info:
        eng.save_checkpoint(tmp_path / "c", extra={"n": 2})
    assert "\n" not in str(info.value)
    assert not (tmp_path / "c.tmp").exists()  # the partial write's space is given back
    fresh = tinypipe.Engine(make_model("llama"), tinypipe.Config(**CFG))
    assert fresh.load_checkpoint(tmp_path / "c") == {"n": 1}
    assert fresh.step_count == 1


def test_save_after_an_interrupted_swap_never_deletes_the_only_copy(tmp_path, monkeypatch) -> None:
    """Killed between the two renames last time, only c.old is left: the next save must keep it
    until the new checkpoint is in place (a failure right before that rename loses nothing)."""
    eng = tinypipe.Engine(make_model("llama"), tinypipe.Config(**CFG))
    eng.step(make_batch(4, 10))
    eng.save_checkpoint(tmp_path / "c", extra={"n": 1})
    os.replace(tmp_path / "c", tmp_path / "c.old")

    def fail_before_swap(phase: str) -> None:
        if phase == "moved-old":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "FAULT_HOOK", fail_before_swap)
    with pytest.raises(ckpt.CheckpointWriteError):
        eng.save_checkpoint(tmp_path / "c", extra={"n": 2})
    fresh = tinypipe.Engine(make_model("llama"), tinypipe.Config(**CFG))
    assert fresh.load_checkpoint(tmp_path / "c") == {"n": 1}
    monkeypatch.setattr(ckpt, "FAULT_HOOK", None)
    eng.save_checkpoint(tmp_path / "c", extra={"n": 2})
    assert fresh.load_checkpoint(tmp_path / "c") == {"n": 2} and not (tmp_path / "c.old").exists()


def test_interrupted_swap_falls_back_to_old(tmp_path) -> None:
    eng = tinypipe.Engine(make_model("llama"), tinypipe.Config(**CFG))
    eng.step(make_batch(4, 10))
    eng.save_checkpoint(tmp_path / "c", extra={"n": 1})
    os.replace(tmp_path / "c", tmp_path / "c.old")  # as if killed between the two renames
    fresh = tinypipe.Engine(make_model("llama"), tinypipe.Config(**CFG))
    assert fresh.load_checkpoint(tmp_path / "c") == {"n": 1}


def test_wrong_model_is_a_clear_error(tmp_path) -> None:
    eng = tinypipe.Engine(make_model("llama"), tinypipe.Config(**CFG))
    eng.save_checkpoint(tmp_path / "c")
    other = tinypipe.Engine(make_model("gpt2"), tinypipe.Config(**CFG))
    with pytest.raises(tinypipe.ConfigError, match="different model|does not match"):
        other.load_checkpoint(tmp_path / "c")
    with pytest.raises(tinypipe.ConfigError, match="no checkpoint"):
        other.load_checkpoint(tmp_path / "missing")
