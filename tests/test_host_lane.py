"""The host AdamW lane as a queue (planner/host_lane.py) and what the time model makes of it: a
lane that lags behind the backward leaves a tail, a resident first pack's backward hides the last
host pack's update, and the turn holds back the lane's start."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import transformers

from benchkit.workloads import WORKLOADS
from tinypipe.planner.cost import predict_step_time
from tinypipe.planner.hardware import load_hardware
from tinypipe.planner.host_lane import Arrival, lane_end_s, pack_arrivals
from tinypipe.planner.sizes import model_sizes
from tinypipe.planner.work import BACKWARD_ADAMW_EFFICIENCY
from tinypipe.schedule.plan import Plan

PLANS = Path(__file__).resolve().parent.parent / "bench" / "plans"


def test_the_lane_waits_for_arrivals_and_queues_behind_itself() -> None:
    """Rate 10/s: 20 elements at t=0 (done 2.0); 10 at t=1 wait for the lane (done 3.0); 10 at t=5
    find it idle (done 6.0); an empty arrival changes nothing, and the order given does not matter."""
    work = [Arrival(5.0, 10), Arrival(0.0, 20), Arrival(9.0, 0), Arrival(1.0, 10)]
    assert lane_end_s(work, 10.0) == pytest.approx(6.0)
    assert lane_end_s(work[1:2] + work[3:], 10.0) == pytest.approx(3.0)
    assert lane_end_s([], 10.0) == 0.0


def test_packs_arrive_in_backward_order_scaled_to_the_phase() -> None:
    """Four packs of 1, 1, 2, 4 s backward (last first), phase stretched to 16 s (2x): pack 3 at 8,
    pack 2 at 12, pack 1 at 14, pack 0 at 16, each + 0.5 s for its last chunk; with the last two
    packs in a turn both arrive when the turn is through (12 + 0.5)."""
    got = pack_arrivals([1.0, 1.0, 2.0, 4.0], [10, 20, 30, 40], range(4, 4), 16.0, 0.5)
    assert [(a.at_s, a.numel) for a in got] == [(8.5, 40), (12.5, 30), (14.5, 20), (16.5, 10)]
    turned = pack_arrivals([1.0, 1.0, 2.0, 4.0], [10, 20, 30, 40], range(2, 4), 16.0, 0.5)
    assert [a.at_s for a in turned] == [12.5, 12.5, 14.5, 16.5]


def _w1() -> tuple:
    return model_sizes(transformers.LlamaConfig(**WORKLOADS["W1"].config)), load_hardware("h200-pcie5")


def test_a_resident_first_pack_hides_the_lane_s_last_work() -> None:
    """W1's turn plan of session 13 (pack 3, turn through the last 3 packs) against the same plan
    with its first pack (block 0) resident: measured 1.582 against 1.539 s/step (medians of 5 runs
    each, bench/results/s14_w1_*), the tail 0.10 against 0.05 s. The model ranks them the same way,
    for the reason the trace shows: the resident plan's tail is shorter."""
    sizes, hw = _w1()
    res1 = Plan.load(PLANS / "s13_w1_turn_res1.json")
    base = dataclasses.replace(res1, resident_packs=0)
    kw = dict(batch=16, seq=2048, clipping=False)
    a, c = predict_step_time(sizes, base, hw, **kw), predict_step_time(sizes, res1, hw, **kw)
    assert c.step_s < a.step_s and c.tail_s < a.tail_s


def test_a_slower_lane_lags_into_the_tail_and_a_turn_starts_it_later() -> None:
    """The same plan on a host whose AdamW runs at half the rate: its tail grows by more than the
    last pack's update alone (the backlog), and without the turn the lane starts earlier and its
    tail is shorter."""
    sizes, hw = _w1()
    plan = dataclasses.replace(Plan.load(PLANS / "s13_w1_turn_res1.json"), resident_packs=0)
    kw = dict(batch=16, seq=2048, clipping=False)
    fast = predict_step_time(sizes, plan, hw, **kw)
    slow_hw = dataclasses.replace(hw, cpu_adamw_gparams_s=hw.cpu_adamw_gparams_s / 2)
    slow = predict_step_time(sizes, plan, slow_hw, **kw)
    block = sizes.layer_train_numels[1] / (hw.cpu_adamw_gparams_s * 1e9 * BACKWARD_ADAMW_EFFICIENCY)
    assert slow.tail_s - fast.tail_s > 2 * block and slow.backward_limit == "cpu optimizer"
    no_turn = dataclasses.replace(plan, turn_packs=0)
    assert predict_step_time(sizes, no_turn, slow_hw, **kw).tail_s < slow.tail_s

