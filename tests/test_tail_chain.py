"""The tail chain of the time model (``planner/cost.py: _tail_chain_excess``): the host AdamW of a
pack starts once its gradients are complete and the host steps one layer after another, so a
pack whose AdamW outlasts the backward below it trails the last backward too -- not only pack
0's. Session 12's H200 traces (``bench/results/s12_w*_turn_defer*_s12b.trace.json``) showed it:
with ``[1, 3 x 9]`` packs W1's AdamW ended 116 ms and W3's 205 ms after the last backward, pack
1's three blocks of AdamW against pack 0's one-block backward. Single-block front packs keep
the chain in step with the backward; the packing options offer them and the search takes them.
"""

from __future__ import annotations

import pytest
import transformers

from tinypipe.perf.workloads import WORKLOADS
from tinypipe.planner.cost import DEVICE_ADAMW_S_PER_PARAM, _Lanes, _tail_chain_excess, predict_step_time
from tinypipe.planner.hardware import load_hardware
from tinypipe.planner.options import pack_options
from tinypipe.planner.search import plan_for
from tinypipe.planner.sizes import model_sizes
from tinypipe.schedule.plan import make_plan

GIB = 1024**3


def _lanes(b_pack: list[float]) -> _Lanes:
    return _Lanes([sum(b_pack)], [sum(b_pack)], [0.0], [0.0], [0.0], [0.0], 0.0, list(b_pack))


def test_the_chain_excess_by_hand() -> None:
    # packs 0..3 (backward order 3, 2, 1, 0); AdamW 1e9 elements/s; every backward 0.05 s
    lanes = _lanes([0.05, 0.05, 0.05, 0.05])
    host = [20_000_000, 90_000_000, 90_000_000, 90_000_000]  # AdamW 0.02, then 0.09 s per pack
    # q = 0: 0.02; q = 1: 0.02 + 0.09 - 0.05 = 0.06; q = 2: 0.20 - 0.10 = 0.10; q = 3: 0.29 - 0.15 = 0.14
    assert _tail_chain_excess(lanes, 0.2, host, 0, 0, 1e9) == pytest.approx(0.14 - 0.02)
    # a backward twice as long (bound elsewhere): each pack's gradients land twice as early, and
    # q = 1: 0.11 - 0.10, q = 2: 0.20 - 0.20, q = 3: 0.29 - 0.30 -- all within pack 0's 0.02
    assert _tail_chain_excess(lanes, 0.4, host, 0, 0, 1e9) == pytest.approx(0.0, abs=1e-12)
    # ... while a 0.3 s one leaves q = 3 at 0.29 - 0.225 = 0.065
    assert _tail_chain_excess(lanes, 0.3, host, 0, 0, 1e9) == pytest.approx(0.065 - 0.02)
    # AdamW no longer than the backward below it: only pack 0's own (no excess)
    assert _tail_chain_excess(lanes, 0.2, [20_000_000] + [40_000_000] * 3, 0, 0, 1e9) == 0.0
    # the embedding's AdamW runs first after the last backward: it is in the chain and the base
    assert _tail_chain_excess(lanes, 0.2, host, 0, 10_000_000, 1e9) == pytest.approx(0.12)
    # a resident pack 0 steps on the device: the chain starts at pack 1
    # q = 1: 0.09; q = 2: 0.18 - 0.05 = 0.13; q = 3: 0.27 - 0.10 = 0.17
    assert _tail_chain_excess(lanes, 0.2, [0] + host[1:], 1, 0, 1e9) == pytest.approx(0.17 - 0.09)
    # everything resident: nothing trails
    assert _tail_chain_excess(lanes, 0.2, [0, 0, 0, 0], 4, 0, 1e9) == 0.0


def _w1_plan(pack_size: list[int]):  # noqa: ANN202 - a Plan
    return make_plan(28, pack_size=pack_size, micro_batch_size=4, backward_micro_batch_size=4, num_devices=1,
                     prefetch_window=3, stash="host", tied=True, device_optimizer="embed")


def test_a_single_block_front_shortens_the_predicted_tail() -> None:
    """W1 on the H200 preset: ``[1, 3 x 9]`` trails pack 1's three blocks of AdamW behind pack 0's
    short backward; ``[1, 1, 1, 1, 3 x 8]`` only pack 0's block. Everything else is the same plan."""
    sizes = model_sizes(transformers.LlamaConfig(**WORKLOADS["W1"].config))
    hw = load_hardware("h200-pcie5")
    kw = dict(batch=16, seq=2048, clipping=False)
    three = predict_step_time(sizes, _w1_plan([1] + [3] * 9), hw, **kw)
    single = predict_step_time(sizes, _w1_plan([1, 1, 1, 1] + [3] * 8), hw, **kw)
    block_adamw = sizes.layer_train_numels[1] / (hw.cpu_adamw_gparams_s * 1e9)
    # pack 1's AdamW (3 blocks) less pack 0's backward: at least a block's AdamW more tail
    assert three.tail_s - single.tail_s > block_adamw
    assert three.tail_s - single.tail_s < 3 * block_adamw
    # the single-block front's tail is pack 0's block, the last gradient chunk and the embedding's
    # step on the GPU only
    last_chunk = sizes.grad_slot_numel * 4 / (hw.d2h_gbs * 1e9)
    embed_on_gpu = sizes.layer_train_numels[0] * DEVICE_ADAMW_S_PER_PARAM
    assert single.tail_s == pytest.approx(block_adamw + last_chunk + embed_on_gpu, rel=1e-9)


def test_the_packing_options_offer_a_single_block_front() -> None:
    opts = pack_options(28)
    assert (1, 1, 1, 1) + (3,) * 8 in opts and (1, 1, 1) + (2,) * 12 + (1,) in opts
    assert all(sum(o) == 28 for o in opts if isinstance(o, tuple))
    assert not any(isinstance(o, tuple) and o[:4] == (1, 1, 1, 1) for o in pack_options(6))  # too few blocks


def test_the_search_puts_single_blocks_in_front_for_w1() -> None:
    w = WORKLOADS["W1"]
    r = plan_for(transformers.LlamaConfig(**w.config), "h200-pcie5", gpus=1, gpu_memory_bytes=24 * GIB,
                 cpu_memory_bytes=120 * GIB, seq=w.seq, global_batch=w.batch)
    packs = r.best.plan.packs
    assert [len(p) for p in packs[:4]] == [1, 1, 1, 1] and len(packs[4]) > 1
    assert r.best.time.tail_s < 0.05  # pack 0's block and the last chunk (no chain behind it)
