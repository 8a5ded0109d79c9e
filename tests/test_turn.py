"""The micro-batch-wise turn (``Plan.turn_packs``): the last packs run forward, the head and their
backward one forward micro-batch at a time, their weights staying in their slots, so each holds
one micro-batch's graph instead of the step's.

Training through a turn must equal plain PyTorch (fp32, the tolerances of
tests/test_equivalence.py) -- a turn of one pack, of several, of every pack, beside streamed kept
packs and recomputed ones from a host stash, backward micro-batches of two forward ones after the
turn, clipping, two devices -- and equal the same plan without the turn bit for bit (the same
graphs, differentiated in another order; dropout included). The runtime holds at most one graph
per turn pack, the schedule interleaves the turn, the estimate counts one micro-batch's graphs
where the turn has them, and plans that cannot run a turn are refused in one line.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from reference import train_plan_against_reference
from test_dropout import gpt2_with_dropout
from tinypipe.errors import ConfigError
from tinypipe.planner.estimate import activation_peaks
from tinypipe.planner.sizes import model_sizes
from tinypipe.runtime.handlers import TaskHandlers
from tinypipe.schedule.builder import build_schedule
from tinypipe.schedule.ids import Kind, compute_lane
from tinypipe.schedule.plan import Plan, make_plan
from tinypipe.schedule.validate import validate

LR, EPS, WD = 1e-3, 1e-6, 0.1
BATCH, SEQ, STEPS = 5, 12, 3

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES = {
    # the last pack alone, micro-batch-wise; window 1
    "last_pack_window1": dict(layers=4, pack_size=2, micro_batch_size=2, prefetch_window=1, turn_packs=1),
    # two of four layer-wise packs; pack 0 streamed and kept, pack 1 recomputed from a host stash
    "two_packs_beside_kept_and_recomputed": dict(layers=4, pack_size=1, micro_batch_size=2, prefetch_window=1,
                                                 stash="host", keep_activations=[True, False, True, True],
                                                 turn_packs=2),
    # every pack in the turn: the embedding's backward follows it directly
    "every_pack": dict(layers=4, pack_size=1, micro_batch_size=2, prefetch_window=2, turn_packs=4),
    # forward micro-batches of 1, backward ones of 2 after the turn; uneven packs; clipping
    "mb1_bwd2_uneven_clip": dict(layers=6, pack_size=[2, 1, 2, 1], micro_batch_size=1,
                                 backward_micro_batch_size=2, prefetch_window=1, stash="host", turn_packs=2,
                                 max_grad_norm=0.5),
    # a resident pack, then streamed ones; the turn's blocks outnumber the largest pack + window
    "resident_first_then_turn_of_three": dict(layers=5, pack_size=1, micro_batch_size=3, resident_packs=1,
                                              prefetch_window=1, turn_packs=3, max_grad_norm=0.5),
}
ENGINE_KNOBS = ("max_grad_norm", "compile_blocks", "dropout_seed")


def _plan_and_config(case: dict, tied: bool, devices: int = 1) -> tuple[Plan, dict]:
    knobs = dict(case)
    layers = knobs.pop("layers")
    cfg = {k: knobs.pop(k) for k in list(knobs) if k in ENGINE_KNOBS}
    knobs.setdefault("backward_micro_batch_size", knobs["micro_batch_size"])
    knobs.setdefault("stash", "device")
    knobs.setdefault("prefetch_window", 1)
    plan = make_plan(layers, num_devices=devices, tied=tied, **knobs)
    return plan, cfg


def _config(cfg: dict, devices: int = 1) -> tinypipe.Config:
    return tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD, head_chunk_tokens=7, devices=["cpu"] * devices,
                           **cfg)


def _batches() -> list[dict]:
    return [make_batch(BATCH, SEQ, seed=i, pad=i == 1) for i in range(STEPS)]


def _train(model: torch.nn.Module, plan: Plan, cfg: dict, batches: list[dict],
           devices: int = 1) -> tuple[list, dict, tinypipe.Engine]:
    engine = tinypipe.Engine(model, _config(cfg, devices), plan=plan)
    results = [engine.step(b) for b in batches]
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    return results, state, engine


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
@pytest.mark.parametrize("name", list(CASES))
def test_turn_matches_pytorch(family: str, name: str) -> None:
    case = CASES[name]
    model = make_model(family, layers=case["layers"])
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    plan, cfg = _plan_and_config(case, tied)
    assert plan.turn_packs == case["turn_packs"] and all(plan.kept(q) for q in plan.turn())
    engine, _ = train_plan_against_reference(model, plan, _batches(), _config(cfg))
    engine.close()


def test_two_devices_turn_through_the_last_pack_matches_pytorch() -> None:
    """cpu,cpu with a tied head (on device 0, the embedding's) and an even pack count: the last pack
    runs its forward and backward on device 0 too, so it can turn there; the other packs rotate."""
    model = make_model("llama", layers=4)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    plan, cfg = _plan_and_config(dict(layers=4, pack_size=1, micro_batch_size=2, turn_packs=1,
                                      max_grad_norm=0.5), tied=True, devices=2)
    assert plan.fwd_device[-1] == plan.bwd_device[-1] == plan.head_device == 0
    assert len(set(plan.fwd_device)) == 2
    engine, _ = train_plan_against_reference(model, plan, _batches(), _config(cfg, devices=2))
    engine.close()


@pytest.mark.parametrize("make,case", [
    (lambda: make_model("llama", layers=4), dict(layers=4, pack_size=1, micro_batch_size=2, prefetch_window=1,
                                                 keep_activations=[False, True, True, True], turn_packs=2,
                                                 max_grad_norm=0.5)),
    (gpt2_with_dropout, dict(layers=4, pack_size=1, micro_batch_size=2, prefetch_window=2, turn_packs=3,
                             dropout_seed=7)),
], ids=["llama_clip", "gpt2_dropout"])
def test_the_turn_equals_the_same_plan_without_it_bit_for_bit(make, case: dict) -> None:
    """The same kept packs with and without the turn: the graphs are the same and each parameter's
    gradient sums the micro-batches in the same order, so losses, norms and weights are identical
    -- with dropout too (each micro-batch's masks come from its own seed, whatever runs between)."""
    batches = [make_batch(BATCH, SEQ, seed=i) for i in range(STEPS)]
    model = make()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    turned, cfg = _plan_and_config(case, tied)
    flat = dataclasses.replace(turned, turn_packs=0)
    a, a_state, ea = _train(make(), flat, cfg, batches)
    b, b_state, eb = _train(make(), turned, cfg, batches)
    assert [(r.loss, r.grad_norm, r.clipped) for r in a] == [(r.loss, r.grad_norm, r.clipped) for r in b]
    assert a_state.keys() == b_state.keys()
    for k in a_state:
        assert torch.equal(a_state[k], b_state[k]), k
    ea.close()
    eb.close()


def test_the_runtime_holds_one_graph_per_turn_pack(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spy around the real ``TaskHandlers._fwd_kept``: when a turn pack records a micro-batch's
    graph, no other graph of that pack is alive (the previous one was differentiated and freed);
    a kept pack outside the turn holds all its micro-batches' graphs until its backward."""
    held: dict[int, int] = {}
    real = TaskHandlers._fwd_kept

    def spy(self: TaskHandlers, task, dev) -> None:  # noqa: ANN001
        real(self, task, dev)
        mine = sum(1 for (q, _) in self._kept if q == task.pack)
        held[task.pack] = max(held.get(task.pack, 0), mine)

    monkeypatch.setattr(TaskHandlers, "_fwd_kept", spy)
    model = make_model("llama", layers=4)
    plan, cfg = _plan_and_config(dict(layers=4, pack_size=1, micro_batch_size=1, prefetch_window=1,
                                      keep_activations=[True, False, True, True], turn_packs=2), False)
    _, _, engine = _train(model, plan, cfg, [make_batch(BATCH, SEQ, seed=0)])
    assert held == {0: BATCH, 2: 1, 3: 1}
    engine.close()


def test_the_schedule_interleaves_the_turn_and_keeps_its_slots() -> None:
    """Compute lane order for a turn through packs 2 and 3 of 4, three forward micro-batches:
    packs 0 and 1 forward over all of them, then per micro-batch f2, f3, head, b3, b2, then
    packs 1 and 0 backward; the turn's backwards run in their forwards' slots, which no upload
    refills before the turn's last backward (the validator proves it too)."""
    plan = make_plan(4, pack_size=1, micro_batch_size=2, backward_micro_batch_size=2, num_devices=1,
                     prefetch_window=1, stash="device", tied=False, turn_packs=2)
    sched = build_schedule(plan, 6, False)
    validate(sched)
    lane = [sched.tasks[t] for t in sched.lanes[compute_lane(0)]]
    short = [f"{t.kind.name[0].lower()}{t.pack if t.pack >= 0 else ''}" for t in lane]
    assert short == (["e"] + ["f0"] * 3 + ["f1"] * 3 + ["f2", "f3", "h", "b3", "b2"] * 3
                     + ["b1"] * 3 + ["b0"] * 3 + ["e"])
    for q in (2, 3):
        fwd = {t.slots for t in lane if t.kind is Kind.FWD and t.pack == q}
        bwd = {t.slots for t in lane if t.kind is Kind.BWD and t.pack == q}
        assert fwd == bwd and len(fwd) == 1
    uploads = [t for t in sched.tasks.values() if t.kind is Kind.UPLOAD]
    assert not [t for t in uploads if t.pack in (2, 3) and t.id.phase == "b"]
    assert plan.param_slots() == 3 and plan.grad_slot_count() == 3  # the turn's 2 + window 1; 2 + pack 1


def test_the_estimate_counts_one_micro_batchs_graph_in_the_turn() -> None:
    """The same kept packs with and without the turn (four forward micro-batches): the turn's
    peak is lower by about three quarters of the turn packs' graphs, less the boundary buffers
    the turn keeps alive across its phases; without keeping, more."""
    cfg = make_model("llama", layers=6).config
    sizes = model_sizes(cfg)
    base = make_plan(6, pack_size=2, micro_batch_size=2, backward_micro_batch_size=2, num_devices=1,
                     prefetch_window=1, stash="host", tied=False, keep_activations=[False, True, True])
    turned = make_plan(6, pack_size=2, micro_batch_size=2, backward_micro_batch_size=2, num_devices=1,
                       prefetch_window=1, stash="host", tied=False, keep_activations=[False, True, True],
                       turn_packs=2)
    kw = dict(batch=8, seq=512, precision="bf16", devices=["cuda:0"])
    plain = activation_peaks(sizes, dataclasses.replace(base, keep_activations=()), **kw)[0]
    kept = activation_peaks(sizes, base, **kw)[0]
    turn = activation_peaks(sizes, turned, **kw)[0]
    graphs = 4 * 8 * 512 * sizes.kept_block_bytes("bf16")  # 2 packs x 2 blocks, the step's tokens
    assert kept - turn >= 0.75 * graphs - 6 * 8 * 512 * sizes.hidden * 2
    assert turn < kept and turn > plain - graphs


@pytest.mark.parametrize("change,why", [
    (dict(keep_activations=(False, True, False, False), turn_packs=2), "must keep its activations"),
    (dict(keep_activations=(False, False, True, True), kept_on_host=(False, False, True, False),
          turn_packs=2), "must keep its activations on the device"),
    (dict(keep_activations=(True,) * 4, turn_packs=5), "turn_packs must be in 0..4"),
    (dict(keep_activations=(True,) * 4, resident_packs=2, turn_packs=3), "turn_packs must be in 0..2"),
    (dict(keep_activations=(True,) * 4, head_device=1, num_devices=2, turn_packs=1), "the turn runs on one"),
])
def test_plans_that_cannot_turn_are_refused(change: dict, why: str) -> None:
    plan = make_plan(4, pack_size=1, micro_batch_size=2, backward_micro_batch_size=2, num_devices=1,
                     prefetch_window=1, stash="device", tied=False)
    with pytest.raises(ConfigError, match=why):
        dataclasses.replace(plan, **change)


def test_make_plan_and_config_refuse_a_turn_they_cannot_keep() -> None:
    with pytest.raises(ConfigError, match="leaves out packs of the turn"):
        make_plan(4, pack_size=1, micro_batch_size=2, backward_micro_batch_size=2, num_devices=1,
                  prefetch_window=1, stash="device", tied=False, keep_activations=[True, True, True, False],
                  turn_packs=1)
    with pytest.raises(ConfigError, match="turn_packs must be a whole number"):
        tinypipe.Config(turn_packs=-1)
    with pytest.raises(ConfigError, match="the planner chooses the packing: turn_packs"):
        tinypipe.planner.search.plan_for(make_model("llama", layers=2).config, "h200-pcie5", gpus=1,
                                         cpu_memory_bytes=2**34, seq=64, global_batch=4, turn_packs=1)


def test_a_turn_round_trips_through_json_settings_and_config() -> None:
    plan = make_plan(4, pack_size=1, micro_batch_size=2, backward_micro_batch_size=2, num_devices=1,
                     prefetch_window=1, stash="device", tied=False, turn_packs=2)
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.settings()["turn_packs"] == 2
    assert "micro-batch-wise turn through the last 2 packs" in plan.describe()
    config = tinypipe.Config(devices=["cpu"], **plan.settings())
    assert make_plan(4, num_devices=1, tied=False, **config.plan_settings()) == plan
    assert "turn_packs" not in dataclasses.replace(plan, turn_packs=0).settings()


def test_the_finetune_flag_reaches_the_config_and_the_plan() -> None:
    """``tinypipe finetune --turn-packs N`` sets ``Config.turn_packs``; with hand-set knobs the
    engine's plan turns through the last N packs (unset: 0)."""
    from tinypipe import cli
    from tinypipe.cli.options import engine_config, resolve_settings
    from tinypipe.planner.auto import manual_plan

    parser = cli.build_parser()
    base = ["finetune", "--model", "m", "--data", "d", "--output", "o", "--pack-size", "1"]
    for flag, want in ((["--turn-packs", "2"], 2), ([], None)):
        config, _ = engine_config(resolve_settings(parser.parse_args(base + flag)))
        assert config.turn_packs == want
        plan = manual_plan(config, num_blocks=4, tied=False)
        k = want or 0
        assert plan.turn_packs == k
        assert [plan.kept(q) for q in range(4)] == [False] * (4 - k) + [True] * k
