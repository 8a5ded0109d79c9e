"""Kept activations (``Plan.keep_activations``): a kept pack's forward records its autograd graph on
the device and its backward differentiates it -- no recompute, no stash read, no replayed draws.

Training through kept packs must equal plain PyTorch (fp32, 1e-5 relative per step, weights 1e-5,
the update vector 1e-4, as tests/test_equivalence.py) -- resident packs kept, the last pack kept
across the forward->backward turn, streamed packs kept (their slots refilled before their
backward: the graph re-reads its weights from the backward's slots, runtime/weight_refs.py), kept
packs mixed with recomputed ones, several forward micro-batches per backward one, two devices,
clipping -- and equal the same engine without keeping bit for bit where the backward micro-batches
are the forward ones (dropout included). Without the weight references a streamed pack's graph
reads overwritten slots, and that must not pass as exact.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from reference import compare, randomize_biases, train_both
from test_dropout import gpt2_with_dropout, llama_lora_with_dropout, run_against_reference
from tinypipe.errors import ConfigError, WorkerError
from tinypipe.runtime.handlers import TaskHandlers
from tinypipe.schedule.builder import build_schedule
from tinypipe.schedule.ids import Kind
from tinypipe.schedule.plan import make_plan
from tinypipe.schedule.validate import _check_kept, validate

LR, EPS, WD = 1e-3, 1e-6, 0.1
BATCH, SEQ, STEPS = 5, 12, 3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_both(family: str, cfg: dict, layers: int = 4) -> tinypipe.Engine:
    model = make_model(family, layers=layers)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [make_batch(BATCH, SEQ, seed=i, pad=i == 1) for i in range(STEPS)]
    engine, ref = train_both(model, model, batches, cfg, lr=LR, eps=EPS, weight_decay=WD)
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5, f"max per-tensor relative weight error {worst:.2e}"
    assert update_err <= 1e-4, f"relative error of the update {update_err:.2e}"
    return engine


KEPT = {
    # the last pack alone, its slots carried across the turn
    "turn_packs2_mb2": (dict(devices=["cpu"], pack_size=2, micro_batch_size=2,
                             keep_activations=[False, True]), (1,)),
    # every pack (True): pack 0 is streamed, its slots refilled before its backward
    "all_packs2_mb2": (dict(devices=["cpu"], pack_size=2, micro_batch_size=2, keep_activations=True), (0, 1)),
    # resident packs kept, the last one recomputed; clipping triggers
    "resident_layerwise_clip": (dict(devices=["cpu"], pack_size=1, micro_batch_size=2, resident_packs=2,
                                     keep_activations=[True, True, False, False], max_grad_norm=0.5), (0, 1)),
    # resident, streamed and turn packs kept, pack 2 recomputed from a host stash; each backward
    # micro-batch is two forward ones (each graph differentiated on its own rows)
    "mixed_mb1_bwd2_host_stash": (dict(devices=["cpu"], pack_size=1, micro_batch_size=1,
                                       backward_micro_batch_size=2, resident_packs=1, stash="host",
                                       keep_activations=[True, True, False, True], prefetch_window=2), (0, 1, 3)),
    # streamed packs kept layer-wise with one slot of read-ahead: their slots are refilled by
    # other layers before their backward, which re-uploads them into the same slots
    "streamed_layerwise_window1_clip": (dict(devices=["cpu"], pack_size=1, micro_batch_size=2,
                                             prefetch_window=1, keep_activations=[True, True, False, False],
                                             max_grad_norm=0.5), (0, 1)),
    # window 2: the backward of packs 1 and 2 runs in other slots than their forward
    # (test_a_streamed_backward_runs_in_other_slots)
    "streamed_other_slots": (dict(devices=["cpu"], pack_size=1, micro_batch_size=2, prefetch_window=2,
                                  keep_activations=[False, True, True, False]), (1, 2)),
    # compiled (AOT autograd, as Inductor partitions): the compact graph's saved weights are the
    # compiled function's, saved by reference
    "streamed_compiled": (dict(devices=["cpu"], pack_size=1, micro_batch_size=2, prefetch_window=2,
                               keep_activations=[False, True, True, False], compile_blocks="aot_eager"), (1, 2)),
    "uneven_packs_window0": (dict(devices=["cpu"], pack_size=[1, 2, 1], micro_batch_size=3, resident_packs=1,
                                  keep_activations=True, prefetch_window=0, max_grad_norm=100.0), (0, 1, 2)),
}


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
@pytest.mark.parametrize("name", list(KEPT))
def test_kept_packs_match_pytorch(family: str, name: str) -> None:
    cfg, kept = KEPT[name]
    engine = run_both(family, dict(cfg))
    assert [q for q in range(engine.plan.num_packs) if engine.plan.kept(q)] == list(kept)
    engine.close()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_two_devices_kept_match_pytorch(family: str) -> None:
    """cpu,cpu: resident pack 0, streamed pack 1 and the last pack (carried across the turn) kept,
    each on the device its forward and backward share; clipping triggers."""
    cfg = dict(devices=["cpu", "cpu"], pack_size=2, micro_batch_size=2, resident_packs=1,
               keep_activations=True, max_grad_norm=0.5)
    engine = run_both(family, cfg, layers=6)
    assert engine.plan.fixed_slot_packs() == (0, 2)
    assert all(engine.plan.kept(q) for q in range(3))
    engine.close()


def test_four_devices_keep_streamed_packs_whose_backward_stays() -> None:
    """cpu x4, layer-wise: the packs whose forward and backward land on one device keep (their
    slots there refilled meanwhile), the others recompute."""
    cfg = dict(devices=["cpu"] * 4, pack_size=1, micro_batch_size=2, keep_activations=True, max_grad_norm=0.5)
    engine = run_both("llama", cfg, layers=6)
    kept = [q for q in range(engine.plan.num_packs) if engine.plan.kept(q)]
    assert kept == list(engine.plan.keepable_packs()) and 0 < len(kept) < engine.plan.num_packs
    assert any(q not in engine.plan.fixed_slot_packs() for q in kept)
    engine.close()


def test_a_streamed_backward_runs_in_other_slots() -> None:
    """The plan of KEPT's ``streamed_other_slots``: kept packs 1 and 2 compute their backward in
    other slots than their forward (so their graphs re-read the weights from elsewhere)."""
    cfg, kept = KEPT["streamed_other_slots"]
    plan = make_plan(4, num_devices=1, tied=False, backward_micro_batch_size=2, stash="device",
                     **{k: v for k, v in cfg.items() if k not in ("devices",)})
    sched = build_schedule(plan, BATCH, False)
    for q in kept:
        fwd = {t.slots for t in sched.tasks.values() if t.kind is Kind.FWD and t.pack == q}
        bwd = {t.slots for t in sched.tasks.values() if t.kind is Kind.BWD and t.pack == q}
        assert len(fwd) == len(bwd) == 1 and fwd != bwd


def _train(model: torch.nn.Module, cfg: dict, batches: list[dict]) -> tuple[list, dict]:
    engine = tinypipe.Engine(model, tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD, head_chunk_tokens=7,
                                                    **cfg))
    results = [engine.step(b) for b in batches]
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    return [(r.loss, r.grad_norm, r.clipped) for r in results], state


@pytest.mark.parametrize("make,cfg", [
    (lambda: make_model("llama", layers=4), dict(devices=["cpu"], pack_size=1, micro_batch_size=2,
                                                 resident_packs=1, max_grad_norm=0.5)),
    (gpt2_with_dropout, dict(devices=["cpu"], pack_size=2, micro_batch_size=2, resident_packs=1,
                             dropout_seed=7)),
    (gpt2_with_dropout, dict(devices=["cpu", "cpu"], pack_size=1, micro_batch_size=3, resident_packs=1,
                             dropout_seed=7)),
], ids=["llama_clip", "gpt2_dropout", "gpt2_dropout_two_devices"])
def test_keeping_equals_recomputing_bit_for_bit(make, cfg: dict) -> None:
    """The same engine with and without kept packs, backward micro-batches = forward ones: the
    graphs differentiated are the recompute's, op for op, so losses, norms and weights are
    bit-identical -- dropout too (the kept graph holds the masks the recompute replays)."""
    batches = [make_batch(BATCH, SEQ, seed=i) for i in range(STEPS)]
    base = make()
    plain_steps, plain_state = _train(base, cfg, batches)
    kept_steps, kept_state = _train(make(), dict(cfg, keep_activations=True), batches)
    assert kept_steps == plain_steps
    assert plain_state.keys() == kept_state.keys()
    for k in plain_state:
        assert torch.equal(plain_state[k], kept_state[k]), k


@pytest.mark.parametrize("cfg", [
    dict(devices=["cpu"], pack_size=2, micro_batch_size=2, resident_packs=1, keep_activations=True),
    dict(devices=["cpu", "cpu"], pack_size=1, micro_batch_size=1, backward_micro_batch_size=2,
         resident_packs=1, keep_activations=True),
], ids=["one_device", "two_devices_mb1_bwd2"])
def test_kept_dropout_matches_pytorch_given_the_same_masks(cfg: dict) -> None:
    """GPT-2 with dropout through kept packs equals plain autograd given the forward's masks
    (tests/test_dropout.py's reference)."""
    run_against_reference(gpt2_with_dropout, cfg).close()


def test_kept_lora_dropout_matches_peft() -> None:
    cfg = dict(devices=["cpu"], pack_size=2, micro_batch_size=2, resident_packs=1, keep_activations=True)
    engine = run_against_reference(llama_lora_with_dropout, cfg)
    assert engine.peft_model is not None and engine.plan.kept(0) and engine.plan.kept(1)
    engine.close()


@pytest.mark.parametrize("name", ["all_packs2_mb2", "streamed_other_slots", "mixed_mb1_bwd2_host_stash"])
def test_full_kept_graphs_match_pytorch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept graphs saved in full (as with dropout, or a QLoRA base): autograd saves the weights
    too, by reference, and the backward re-reads them from its own slots."""
    monkeypatch.setattr(TaskHandlers, "_compact", lambda self, dev: False)
    cfg, kept = KEPT[name]
    engine = run_both("llama", dict(cfg))
    assert [q for q in range(engine.plan.num_packs) if engine.plan.kept(q)] == list(kept)
    engine.close()


@pytest.mark.parametrize("sabotage", ["full_graph_without_weight_references", "compact_graph_unbound",
                                      "compiled_compact_graph_without_weight_references"])
def test_a_streamed_graph_reading_the_forwards_slots_is_wrong(sabotage: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeping streamed packs whose backward runs in other slots, with what makes their weights
    the backward's switched off -- a full graph's weight references, or a compact graph's
    rebinding (its recompute then reads the forward's slots, which hold other layers): the run
    must not pass as exact. So test_kept_packs_match_pytorch passes because of them. (A compiled
    compact graph saves the weights as autograd tensors: it needs the references too.)"""
    import contextlib

    from reference import assert_steps_match, train_reference
    from tinypipe.runtime.weight_refs import WeightRefs

    cfg, _ = KEPT["streamed_other_slots"]
    if sabotage == "full_graph_without_weight_references":
        monkeypatch.setattr(TaskHandlers, "_compact", lambda self, dev: False)
    if sabotage == "compact_graph_unbound":
        monkeypatch.setattr(TaskHandlers, "_rebind_kept", lambda self, task, dev: None)
    else:
        monkeypatch.setattr(WeightRefs, "saving", lambda self: contextlib.nullcontext())
    if sabotage.startswith("compiled"):  # AOT autograd saves the weights among its tensors
        cfg = dict(cfg, compile_blocks="aot_eager")
    model = make_model("llama", layers=4)
    batches = [make_batch(BATCH, SEQ, seed=i) for i in range(STEPS)]
    ref = train_reference(model, batches, lr=LR, eps=EPS, weight_decay=WD)
    engine = tinypipe.Engine(model, tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD, **cfg))
    with pytest.raises((WorkerError, AssertionError)):
        assert_steps_match([engine.step(b) for b in batches], ref, None)
    engine.close()


def test_unkeepable_packs_are_refused() -> None:
    """The plan refuses a kept pack whose forward and backward run on two devices, or backward
    micro-batches that split forward ones; the config a wrong value."""
    plan = make_plan(4, pack_size=1, micro_batch_size=2, backward_micro_batch_size=2, num_devices=1,
                     prefetch_window=1, stash="device", tied=False)
    three = make_plan(4, pack_size=1, micro_batch_size=2, backward_micro_batch_size=2, num_devices=3,
                      prefetch_window=1, stash="device", tied=False)
    assert three.fixed_slot_packs() == ()  # on 3 devices the last pack's backward runs elsewhere
    assert 3 not in three.keepable_packs()
    with pytest.raises(ConfigError, match="device"):
        dataclasses.replace(three, keep_activations=(False, False, False, True))
    with pytest.raises(ConfigError, match="multiple"):
        dataclasses.replace(plan, backward_micro_batch_size=3, keep_activations=(False, False, False, True))
    with pytest.raises(ConfigError, match="per pack"):
        dataclasses.replace(plan, keep_activations=(True,))
    with pytest.raises(ConfigError, match="keep_activations"):
        tinypipe.Config(keep_activations="yes")


def test_validator_refuses_a_layer_changed_between_forward_and_backward() -> None:
    """A kept pack's layer updated between its forward and its backward (an update task moved
    into that window) is refused: the backward would re-read other weights than the forward's."""
    plan = make_plan(4, pack_size=1, micro_batch_size=2, backward_micro_batch_size=2, num_devices=1,
                     prefetch_window=1, stash="device", tied=False, keep_activations=[True, False, False, False])
    sched = build_schedule(plan, 7, False)
    validate(sched)
    order = list(sched.order)
    upd = next(t for t in order if sched.tasks[t].kind is Kind.UPDATE and sched.tasks[t].layers == (1,))
    order.remove(upd)
    first_fwd = next(i for i, t in enumerate(order) if sched.tasks[t].kind is Kind.FWD and sched.tasks[t].pack == 0)
    order.insert(first_fwd + 1, upd)
    sched.order = order
    with pytest.raises(ConfigError, match="kept pack 0"):
        _check_kept(sched)


@pytest.mark.parametrize("devices", [1, 2, 3, 4])
@pytest.mark.parametrize("resident", [0, 1, 2])
@pytest.mark.parametrize("pack", [1, 2, (1, 3, 2)])
def test_validator_accepts_exactly_the_keepable_packs(devices: int, resident: int, pack) -> None:
    """Every pack :meth:`Plan.keepable_packs` names validates as kept (alone and all together);
    the fixed-slot packs are among them; every other pack is refused by the plan."""
    try:
        plan = make_plan(6, pack_size=pack, micro_batch_size=2, backward_micro_batch_size=4,
                         num_devices=devices, prefetch_window=1, stash="device", tied=False,
                         resident_packs=resident)
    except ConfigError:  # this placement splits a resident pack across devices
        return
    P = plan.num_packs
    keepable = plan.keepable_packs()
    assert set(range(resident)) <= set(plan.fixed_slot_packs()) <= set(keepable)
    assert plan.keepable_packs(streamed=False) == plan.fixed_slot_packs()
    if devices == 1:
        assert keepable == tuple(range(P))
    if keepable:
        validate(build_schedule(dataclasses.replace(plan, keep_activations=tuple(
            q in keepable for q in range(P))), 7, False))
    for q in range(P):
        try:
            one = dataclasses.replace(plan, keep_activations=tuple(i == q for i in range(P)))
        except ConfigError:  # forward and backward on two devices: refused by the plan itself
            assert q not in keepable
            continue
        assert q in keepable
        validate(build_schedule(one, 7, False))


def test_plan_round_trip_and_settings() -> None:
    plan = make_plan(6, pack_size=2, micro_batch_size=2, backward_micro_batch_size=2, num_devices=2,
                     prefetch_window=1, stash="device", tied=False, resident_packs=1,
                     keep_activations=[True, False, True])
    assert plan.keep_activations == (True, False, True)
    assert plan.describe().endswith("activations kept (no recompute) for packs 0,2")
    every = make_plan(6, num_devices=2, tied=False, **dict(plan.settings(), keep_activations=True))
    assert every.keep_activations == (True, True, True)
    assert type(plan).from_json(plan.to_json()) == plan
    assert plan.settings()["keep_activations"] == (True, False, True)
    assert make_plan(6, num_devices=2, tied=False, **plan.settings()) == plan
    none = dataclasses.replace(plan, keep_activations=(False, False, False))
    assert none.keep_activations == () and "keep_activations" not in none.settings()
    assert tinypipe.Config(pack_size=2, keep_activations=[True, False]).keep_activations == (True, False)
    assert "keep_activations" not in tinypipe.Config(pack_size=2).plan_settings()


def test_finetune_flag_reaches_the_config() -> None:
    from tinypipe import cli
    from tinypipe.cli.options import engine_config, resolve_settings

    parser = cli.build_parser()
    base = ["finetune", "--model", "m", "--data", "d", "--output", "o", "--pack-size", "2"]
    for flag, want in ((["--keep-activations", "on"], True), (["--keep-activations", "off"], False), ([], None)):
        config, _ = engine_config(resolve_settings(parser.parse_args(base + flag)))
        assert config.keep_activations is want
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--keep-activations", "maybe"])
