"""The physical bound (benchkit.analysis.step_bound) with the compute three ways -- no
recompute, the plan's, the least memory forces -- and the memory limit on kept activations
(benchkit.keep_limit, fed by bench/decompose.py) on the tiny workload's real sizes, plan and
memory estimate."""

from __future__ import annotations

import dataclasses

import importlib.util
from pathlib import Path

import pytest
import transformers

from benchkit.analysis import step_bound, step_flops
from benchkit.keep_limit import keep_limit as keep_limit_of_counts
from benchkit.workloads import WORKLOADS
from tinypipe.devices.rates import MachineRates
from tinypipe.planner.candidate import FRAGMENTATION, GPU_CONTEXT_BYTES
from tinypipe.planner.estimate import estimate_memory
from tinypipe.planner.sizes import model_sizes
from tinypipe.schedule.plan import Plan, make_plan

RATES = MachineRates(h2d_gbs=50.0, d2h_gbs=50.0, both_gbs=80.0, matmul_tflops=1.0, adamw_gparams_s=4.0,
                     device_name="synthetic")
TINY = WORKLOADS["tiny"]

_spec = importlib.util.spec_from_file_location(
    "decompose", Path(__file__).resolve().parents[1] / "bench" / "decompose.py")
DEC = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(DEC)  # type: ignore[union-attr]
keep_limit, pack_recomputes = DEC.plan_keep_limit, DEC.pack_recomputes
recomputed_blocks = DEC.recomputed_blocks


@pytest.fixture(scope="module")
def sizes():
    return model_sizes(transformers.LlamaConfig(**TINY.config))


def tiny_plan(sizes, pack_size: int = 2, **kw) -> Plan:
    return make_plan(sizes.num_blocks, pack_size=pack_size, micro_batch_size=2, backward_micro_batch_size=2,
                     num_devices=1, prefetch_window=1, stash="device", tied=True, **kw)


def test_tiny_block_params_are_the_llama_formula(sizes) -> None:
    """hidden 256, 4 heads of 64 (2 kv heads), MLP 688, two norms: the numbers the ratio below uses."""
    c = TINY.config
    h, kv = c["hidden_size"], c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    assert sizes.block_params[0] == 2 * h * h + 2 * h * kv + 3 * h * c["intermediate_size"] + 2 * h


def test_no_recompute_is_below_recompute_by_the_flop_ratio(sizes) -> None:
    c, S, B, L = TINY.config, TINY.seq, TINY.batch, TINY.config["num_hidden_layers"]
    N, H, Nh = sum(sizes.block_params), c["hidden_size"], sizes.head_matmul_params
    T = S * B
    fwd = 2 * N * T + 2 * S * S * H * B * L  # the blocks' forward FLOPs (attention halved for causality)
    head = 6 * Nh * T
    b = step_bound(sizes.param_count, N, Nh, L, H, S, B, RATES)
    assert b.recompute_fraction == 1.0
    assert b.compute_s == pytest.approx((4 * fwd + head) / 1e12)
    assert b.compute_no_recompute_s == pytest.approx((3 * fwd + head) / 1e12)
    assert b.compute_no_recompute_s / b.compute_s == pytest.approx((3 * fwd + head) / (4 * fwd + head))
    assert b.compute_no_recompute_s < b.compute_s
    # half the blocks recomputed: half way; the old flag still means all / none
    half = step_bound(sizes.param_count, N, Nh, L, H, S, B, RATES, recompute_fraction=0.5)
    assert half.compute_s == pytest.approx((3.5 * fwd + head) / 1e12)
    off = step_bound(sizes.param_count, N, Nh, L, H, S, B, RATES, recompute=False)
    assert off.compute_s == pytest.approx(b.compute_no_recompute_s)
    assert step_flops(N, Nh, L, H, S, B, 0.25) == pytest.approx(3.25 * fwd + head)
    with pytest.raises(ValueError):
        step_flops(N, Nh, L, H, S, B, 1.5)


def test_bound_ceiling_and_forced_bound() -> None:
    """Compute-bound numbers: the ceiling is the no-recompute compute, the forced bound between."""
    slow_mm = MachineRates(1e3, 1e3, 1e3, 0.001, 1e3, "synthetic")
    b = step_bound(10**6, 10**6, 10**5, 4, 256, 128, 8, slow_mm, forced_fraction=0.5)
    assert b.ceiling_s == b.compute_no_recompute_s < b.forced_bound_s == b.compute_forced_s < b.bound_s
    d = b.as_dict()
    for key in ("compute", "upload", "download", "cpu optimizer", "bound_s"):  # the keys the JSON had
        assert key in d
    assert d["ceiling_s"] == b.ceiling_s and d["forced_recompute_fraction"] == 0.5
    # link-bound: every variant of the compute hides under the upload
    fast_mm = MachineRates(0.001, 1e3, 1e3, 1e3, 1e3, "synthetic")
    b = step_bound(10**6, 10**6, 10**5, 4, 256, 128, 8, fast_mm, forced_fraction=0.5)
    assert b.bound_s == b.ceiling_s == b.forced_bound_s == b.upload_s
    assert step_bound(1, 1, 1, 1, 1, 1, 1, slow_mm).forced_bound_s is None


def test_recomputed_blocks_with_and_without_keep_activations(sizes) -> None:
    plan = tiny_plan(sizes)  # 2 packs of 2
    assert pack_recomputes(plan) == (True, True) and recomputed_blocks(plan) == 4
    assert recomputed_blocks(dataclasses.replace(plan, keep_activations=(True, False))) == 2
    assert recomputed_blocks(dataclasses.replace(plan, keep_activations=(False, True))) == 2
    assert recomputed_blocks(dataclasses.replace(plan, keep_activations=(True, True))) == 0
    assert pack_recomputes(dataclasses.replace(plan, keep_activations=(False, True))) == (True, False)


def _need(memory) -> int:
    (name,) = memory.devices
    act = memory.devices[name]["activations_peak"]
    return memory.device_total(name) + act + int(FRAGMENTATION * act) + GPU_CONTEXT_BYTES


def test_keep_limit_counts_whole_blocks_of_the_free_memory(sizes) -> None:
    plan = tiny_plan(sizes, pack_size=1)
    mem = estimate_memory(sizes, plan, batch=TINY.batch, seq=TINY.seq, precision="bf16", devices=["cuda:0"])
    act = sizes.block_act_bytes("bf16")
    per_block = TINY.tokens * act * (1 + FRAGMENTATION)
    need = _need(mem)
    kw = dict(tokens=TINY.tokens, act_bytes_per_token=act)
    lim = keep_limit(plan, mem, budget_bytes=need + int(2.5 * per_block), **kw)
    assert lim.bytes_per_block == pytest.approx(per_block)
    assert (lim.keepable_blocks, lim.forced_blocks, lim.forced_fraction) == (2, 2, 0.5)
    assert lim.need_bytes == (need,)
    assert keep_limit(plan, mem, budget_bytes=need - 1, **kw).keepable_blocks == 0
    assert keep_limit(plan, mem, budget_bytes=need + 100 * int(per_block), **kw).keepable_blocks == 4
    free = keep_limit(plan, mem, budget_bytes=None, **kw)
    assert free.forced_blocks == 0 and "no GPU budget" in free.describe()
    assert "at most 2 of 4 blocks kept" in lim.describe()
    # packs that keep already count as kept; the free room goes to the others
    kept = dataclasses.replace(plan, keep_activations=(True, False, False, False))
    assert keep_limit(kept, mem, budget_bytes=need + int(1.5 * per_block), **kw).keepable_blocks == 2


def test_keep_limit_per_device(sizes) -> None:
    """Two devices: each device's room holds the blocks whose backward it runs, no more."""
    plan = make_plan(sizes.num_blocks, pack_size=1, micro_batch_size=2, backward_micro_batch_size=2,
                     num_devices=2, prefetch_window=1, stash="device", tied=True)
    mem = estimate_memory(sizes, plan, batch=TINY.batch, seq=TINY.seq, precision="bf16",
                          devices=["cuda:0", "cuda:1"])
    act = sizes.block_act_bytes("bf16")
    lim = keep_limit(plan, mem, budget_bytes=10**12, tokens=TINY.tokens, act_bytes_per_token=act)
    assert lim.keepable_blocks == 4 and len(lim.need_bytes) == 2
    per_block = lim.bytes_per_block
    # round-robin: each device runs two packs' backward; device 0 (embedding, head) needs more
    assert [sum(1 for d in plan.bwd_device if d == i) for i in range(2)] == [2, 2]
    fullest = max(range(2), key=lambda i: lim.need_bytes[i])
    assert lim.need_bytes[fullest] - min(lim.need_bytes) > 2 * per_block
    budget = lim.need_bytes[fullest] + int(1.2 * per_block)  # room for one block on the fullest
    got = keep_limit(plan, mem, budget_bytes=budget, tokens=TINY.tokens, act_bytes_per_token=act)
    assert got.keepable_blocks == 1 + 2  # not 4: the fullest device's room is not shared


def test_keep_limit_arithmetic() -> None:
    lim = keep_limit_of_counts([100, 300], [3, 3], kept_now=1, bytes_per_block=40.0, budget_bytes=200)
    # 100 B free on the first device: 2 blocks; none on the second
    assert (lim.keepable_blocks, lim.num_blocks) == (1 + 2 + 0, 7)
    assert lim.forced_blocks == 4 and lim.forced_fraction == pytest.approx(4 / 7)
    roomy = keep_limit_of_counts([0], [5], kept_now=0, bytes_per_block=1.0, budget_bytes=10)
    assert roomy.keepable_blocks == 5  # never more than the blocks there
    with pytest.raises(ValueError):
        keep_limit_of_counts([0, 0], [1], kept_now=0, bytes_per_block=1.0, budget_bytes=None)
