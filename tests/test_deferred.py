"""A clipped step's leftover optimizer work runs while the next step starts: exact, and failures surface.

The next step's upload of a layer must wait for that layer's update. A deliberately slow
optimizer on the background lane makes a missing wait visible (the next forward would read the
old weights and the losses would diverge from plain PyTorch).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from reference import compare, randomize_biases, train_both
from tinypipe.errors import WorkerError
from tinypipe.runtime.optim.adamw import ChunkedAdamW
from tinypipe.schedule.ids import BACKGROUND_LANE

LR, EPS, WD = 1e-3, 1e-6, 0.1


def _on_deferred_lane() -> bool:
    return str(BACKGROUND_LANE) in threading.current_thread().name


@pytest.fixture
def slow_deferred_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ChunkedAdamW.step

    def slow(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if _on_deferred_lane():
            time.sleep(0.01)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ChunkedAdamW, "step", slow)


@pytest.mark.parametrize("family,cfg", [
    ("llama", dict(devices=["cpu"], pack_size=1, micro_batch_size=2)),
    ("gpt2", dict(devices=["cpu"] * 2, pack_size=2, micro_batch_size=3, backward_micro_batch_size=2,
                  stash="host")),
])
def test_slow_background_updates_still_match_pytorch(slow_deferred_optimizer: None, family: str,
                                                     cfg: dict) -> None:
    model = make_model(family, layers=4)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [make_batch(5, 12, seed=i) for i in range(4)]
    # a threshold every step exceeds: step 1 speculates and rolls back, later steps defer all layers
    engine, ref = train_both(model, model, batches, dict(cfg, max_grad_norm=1e-3), lr=LR, eps=EPS,
                             weight_decay=WD)
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    engine.close()


def test_step_returns_before_the_clipped_update_and_readers_wait(slow_deferred_optimizer: None) -> None:
    model = make_model("llama", layers=4)
    engine = tinypipe.Engine(model, tinypipe.Config(devices=["cpu"], pack_size=1, micro_batch_size=5, lr=LR,
                                                    max_grad_norm=1e-3))
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    r = engine.step(make_batch(5, 12))
    assert r.clipped
    assert engine.optimizer.background.pending  # the update overlaps whatever comes next
    after = engine.state_dict()  # waits for it
    assert not engine.optimizer.background.pending
    assert all(not torch.equal(before[k], after[k]) for k in before)
    engine.close()


def test_a_failing_background_update_surfaces_in_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ChunkedAdamW.step

    def broken(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if _on_deferred_lane():
            raise MemoryError("injected")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ChunkedAdamW, "step", broken)
    engine = tinypipe.Engine(make_model("llama", layers=3), tinypipe.Config(
        devices=["cpu"], pack_size=1, micro_batch_size=5, max_grad_norm=1e-3, stall_timeout_s=30))
    engine.step(make_batch(5, 12))
    t0 = time.monotonic()
    failed = "deferred optimizer update of layer 0 failed: MemoryError: injected"
    with pytest.raises(WorkerError, match=failed):
        engine.step(make_batch(5, 12, seed=1))
    assert time.monotonic() - t0 < 10
    with pytest.raises(WorkerError, match="engine unusable"):
        engine.step(make_batch(5, 12, seed=2))
    with pytest.raises(WorkerError, match="injected"):
        engine.synchronize()
    engine.close()  # does not raise


def test_background_work_follows_the_next_steps_upload_order() -> None:
    """The head's upload comes after pack 0's: its leftover update must not hold pack 0 back."""
    engine = tinypipe.Engine(make_model("llama", layers=4), tinypipe.Config(
        devices=["cpu"], pack_size=2, micro_batch_size=5, max_grad_norm=1e-3))
    engine.step(make_batch(5, 12))
    engine.synchronize()
    done = [layer for layer, _, _ in engine.optimizer.background.timings]
    order = engine.schedule_for(5).upload_order()
    assert done == sorted(done, key=order.__getitem__)
    assert done == [0, 1, 2, 5, 3, 4]  # embedding, pack 0, head, pack 1
    engine.close()
