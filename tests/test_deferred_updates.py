"""Deferred updates (``Plan.deferred``): the host AdamW of those layers always waits for the step's
end and runs in the background during the next step's forward, before their upload there -- the
host is idle in the forward, while after a micro-batch-wise turn its queue trails the backward.

Training with deferred layers must equal plain PyTorch (fp32, the tolerances of
tests/test_equivalence.py) -- the turn's layers, pack 0's and the embedding (needed first), with
clipping, two devices -- and equal the same plan without them bit for bit (the same fused AdamW
call per layer, later). Their updates really run after the step (the background lane's timeline
names exactly them), a checkpoint or an evaluation taken while they are pending sees them applied,
their gradients take 4 B per element of host memory (the estimate counts the same), and plans
that cannot defer a layer are refused in one line.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from reference import train_plan_against_reference
from tinypipe.errors import ConfigError
from tinypipe.planner.estimate import host_bytes
from tinypipe.planner.sizes import model_sizes
from tinypipe.runtime.optim.decisions import StepDecisions
from tinypipe.schedule.ids import BACKGROUND_LANE
from tinypipe.schedule.plan import Plan, make_plan

LR, EPS, WD = 1e-3, 1e-6, 0.1
BATCH, SEQ, STEPS = 5, 12, 3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _plan(layers: int, deferred: tuple[int, ...], tied: bool, devices: int = 1, **knobs) -> Plan:
    base = dict(pack_size=1, micro_batch_size=2, backward_micro_batch_size=2, prefetch_window=1,
                stash="host")
    base.update(knobs)
    plan = make_plan(layers, num_devices=devices, tied=tied, **base)
    return dataclasses.replace(plan, deferred=deferred)


def _config(devices: int = 1, **cfg) -> tinypipe.Config:
    return tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD, head_chunk_tokens=7, devices=["cpu"] * devices,
                           **cfg)


def _engine(model: torch.nn.Module, plan: Plan, devices: int = 1, **cfg) -> tinypipe.Engine:
    return tinypipe.Engine(model, _config(devices, **cfg), plan=plan)


CASES = {
    # a turn through the last 2 of 4 packs, its layers deferred
    "turn_layers": dict(layers=4, deferred=(3, 4), knobs=dict(turn_packs=2)),
    # pack 0's layer and the embedding: the first the next forward uploads
    "first_layers": dict(layers=4, deferred=(0, 1), knobs={}),
    # the head and a middle block, clipping every step (every gradient retained then)
    "head_and_middle_clip": dict(layers=4, deferred=(2, 5), knobs={}, clip=0.5),
    # two devices, the deferred layers on both
    "two_devices": dict(layers=4, deferred=(2, 3, 4), knobs={}, devices=2),
}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("name", list(CASES))
def test_deferred_updates_match_pytorch(family: str, name: str) -> None:
    case = CASES[name]
    model = make_model(family, layers=case["layers"])
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    devices = case.get("devices", 1)
    plan = _plan(case["layers"], case["deferred"], tied, devices, **case["knobs"])
    batches = [make_batch(BATCH, SEQ, seed=i, pad=i == 1) for i in range(STEPS)]
    engine, _ = train_plan_against_reference(model, plan, batches,
                                             _config(devices, max_grad_norm=case.get("clip")))
    engine.close()


def test_deferring_equals_stepping_at_once_bit_for_bit() -> None:
    """The same plan with and without deferred layers: each layer gets the same fused AdamW call
    on the same gradient, only later, so weights and moments are identical."""
    batches = [make_batch(BATCH, SEQ, seed=i) for i in range(STEPS)]
    states = []
    for deferred in ((), (1, 3, 4, 5)):
        torch.manual_seed(0)
        model = make_model("llama", layers=4)
        engine = _engine(model, _plan(4, deferred, False, turn_packs=1))
        losses = [engine.step(b).loss for b in batches]
        states.append((losses, {k: v.clone() for k, v in engine.state_dict().items()}))
        engine.close()
    (la, a), (lb, b) = states
    assert la == lb
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_the_deferred_updates_run_after_the_step_in_the_background() -> None:
    """Unclipped: the background lane of step 2's timeline holds exactly step 1's updates of the
    deferred layers; without deferred layers it holds none."""
    batches = [make_batch(BATCH, SEQ, seed=i) for i in range(2)]
    for deferred in ((), (2, 4)):
        engine = _engine(make_model("llama", layers=4), _plan(4, deferred, False))
        for b in batches:
            engine.step(b)
        names = sorted(e["name"] for e in engine.step_timeline() if e["lane"] == str(BACKGROUND_LANE))
        assert names == [f"upd/L{layer} (last step's, left over)" for layer in deferred]
        engine.close()


def test_a_checkpoint_and_an_evaluation_see_the_pending_updates(tmp_path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint taken while the deferred updates are pending applies them first: resumed, the
    run ends bit-identical to an uninterrupted one; an evaluation in between sees them too (its
    loss is the one of the same engine without deferred layers). The leftover updates are slowed
    down (a sleep before the real one) so that they are still pending when it is asked."""
    real = StepDecisions._redo

    def slow(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        time.sleep(0.2)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(StepDecisions, "_redo", slow)
    batches = [make_batch(BATCH, SEQ, seed=i) for i in range(4)]
    held_out = make_batch(3, SEQ, seed=99)
    plan = _plan(4, (1, 4), False)

    def fresh() -> tinypipe.Engine:
        torch.manual_seed(0)
        return _engine(make_model("llama", layers=4), plan)

    straight = fresh()
    for b in batches:
        straight.step(b)
    first = fresh()
    plain = _engine(make_model_seeded(), dataclasses.replace(plan, deferred=()))
    for b in batches[:2]:
        first.step(b)
        plain.step(b)
    assert first.optimizer.background.pending  # the last step's deferred updates
    assert first.evaluate(held_out).loss == plain.evaluate(held_out).loss
    first.step(batches[2])
    assert first.optimizer.background.pending
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    resumed = fresh()
    resumed.load_checkpoint(tmp_path / "ckpt")
    resumed.step(batches[3])
    a, b = resumed.state_dict(), straight.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for e in (straight, resumed, plain):
        e.close()


def make_model_seeded() -> torch.nn.Module:
    torch.manual_seed(0)
    return make_model("llama", layers=4)


def test_their_gradients_take_host_memory_as_the_estimate_counts() -> None:
    """Unclipped, each deferred layer keeps an fp32 gradient copy in host memory until its update:
    the engine's ``gradient_buffers`` and the estimator's agree to the byte (and are 0 without)."""
    model = make_model("llama", layers=4)
    sizes = model_sizes(model.config)
    for deferred in ((), (0, 2, 4)):
        plan = _plan(4, deferred, False)
        engine = _engine(make_model("llama", layers=4), plan)
        engine.step(make_batch(BATCH, SEQ, seed=0))
        measured = engine.memory_report().host.get("gradient_buffers", 0)
        est = host_bytes(sizes, plan, batch=BATCH, seq=SEQ, precision="fp32",
                         num_devices=1)["gradient_buffers"]
        assert measured == est == 4 * sum(sizes.layer_train_numels[layer] for layer in deferred)
        engine.close()


@pytest.mark.parametrize("change,why", [
    (dict(deferred=(7,)), "deferred layers must be in 0..5"),
    (dict(deferred=(0,), device_optimizer="embed"), "layer 0 is stepped on its device"),
    (dict(deferred=(2,), assisted=(2,)), "layer 2 is assisted"),
    (dict(deferred=(1,), resident_packs=1), "layer 1 is stepped on its device"),
    (dict(deferred=(2,), offload=((2, "moments"),)), "layer 2 has state on the SSD"),
    (dict(deferred=(2,), replicas=2), "replicas step their shards"),
])
def test_plans_that_cannot_defer_a_layer_are_refused(change: dict, why: str) -> None:
    plan = make_plan(4, pack_size=1, micro_batch_size=2, backward_micro_batch_size=2, num_devices=1,
                     prefetch_window=1, stash="device", tied=False)
    with pytest.raises(ConfigError, match=why):
        dataclasses.replace(plan, **change)


def test_deferred_layers_round_trip_through_json() -> None:
    plan = _plan(4, (4, 3), False, turn_packs=2)
    assert plan.deferred == (3, 4)
    assert Plan.from_json(plan.to_json()) == plan
    assert "2 layers' AdamW deferred to the next forward" in plan.describe()
