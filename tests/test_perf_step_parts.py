"""The step decomposition (benchkit.step_parts, and bench/decompose.py that feeds it an engine's
timeline): every instant of the step counted once, exposed time only where no compute lane is
busy, the recompute split by the time model's share -- on hand-built timelines, random ones, and
a real engine step."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchkit.analysis import lane_busy
from benchkit.step_parts import COMPUTE_PARTS, PARTS, Span
from benchkit.step_parts import decompose as decompose_spans
from tinypipe.planner.hardware import HardwareSpec
from tinypipe.planner.layer_profile import LayerProfile, ProfilePoint


BENCH = Path(__file__).resolve().parents[1] / "bench"


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


DEC = _bench_module("decompose")
decompose, lane_role, phases = DEC.step_decomposition, DEC.lane_role, DEC.phases
predicted_phases, recompute_share = DEC.predicted_phases, DEC.recompute_share


def ev(lane: str, name: str, start_ms: float, dur_ms: float) -> dict:
    return {"lane": lane, "name": name, "start_us": start_ms * 1e3, "dur_us": dur_ms * 1e3}


def ms(d: dict, part: str) -> float:
    return d["parts"][part] * 1e3


def test_lane_roles() -> None:
    assert [lane_role(x) for x in ("dev0:compute", "dev1:h2d", "dev0:d2h", "host:optimizer",
                                    "host:deferred-optimizer", "dev0:collective", "ssd:read")] == \
        ["compute", "upload", "download", "optimizer", "optimizer", "other", "other"]


def test_hand_built_overlaps() -> None:
    """0-10 fwd with an upload 5-15 (5 ms exposed); 20-50 bwd; optimizer 45-65 with a download
    48-58 under it (the download, not the optimizer, is exposed 50-58); optimizer alone 58-65;
    idle 15-20 and 65-80."""
    events = [
        ev("dev0:compute", "fwd/0/0", 0, 10),
        ev("dev0:h2d", "up/f1/L2", 5, 10),
        ev("dev0:compute", "bwd/0/0", 20, 30),
        ev("host:optimizer", "upd/L1", 45, 20),
        ev("dev0:d2h", "dl/L1", 48, 10),
    ]
    d = decompose(events, 0.080, recompute_share=0.25)
    assert ms(d, "forward") == pytest.approx(10)
    assert ms(d, "backward") == pytest.approx(30 * 0.75)
    assert ms(d, "recompute") == pytest.approx(30 * 0.25)
    assert ms(d, "exposed upload") == pytest.approx(5)
    assert ms(d, "exposed download") == pytest.approx(8)
    assert ms(d, "exposed optimizer") == pytest.approx(7)
    assert ms(d, "idle") == pytest.approx(20)
    assert sum(d["parts"].values()) == pytest.approx(0.080, abs=1e-12)
    # the brief's definition per lane (busy while no compute lane is), overlapping one another
    assert d["exposed_any"]["download"] * 1e3 == pytest.approx(8)
    assert d["exposed_any"]["optimizer"] * 1e3 == pytest.approx(15)


def test_overlap_is_not_double_counted() -> None:
    """Two devices computing at once and transfers hidden under them: the compute is wall time
    (not the lanes' 90 ms of busy time), the hidden transfers expose nothing, and the parts still
    sum to the 60 ms step -- summing lane busy times would give 90 + 40 ms."""
    events = [
        ev("dev0:compute", "fwd/0/0", 0, 50),
        ev("dev1:compute", "fwd/1/0", 10, 40),
        ev("dev0:h2d", "up/f2/L3", 0, 40),
        ev("dev1:d2h", "dl/L1", 5, 0),  # empty span
        ev("host:optimizer", "upd/L1", 30, 20),
    ]
    d = decompose(events, 0.060)
    assert ms(d, "forward") == pytest.approx(50)
    for part in ("exposed upload", "exposed download", "exposed optimizer"):
        assert d["parts"][part] == 0.0
    assert ms(d, "idle") == pytest.approx(10)
    assert sum(d["parts"].values()) == pytest.approx(0.060, abs=1e-12)


def test_concurrent_compute_tasks_share_the_instant() -> None:
    """A forward on one device beside a recomputing backward on another for 10 ms: 5 ms each, the
    backward's 5 ms split by the share."""
    events = [ev("dev0:compute", "fwd/1/0", 0, 10), ev("dev1:compute", "bwd/0/0", 0, 10)]
    d = decompose(events, 0.010, recompute_share=0.4)
    assert ms(d, "forward") == pytest.approx(5)
    assert ms(d, "recompute") == pytest.approx(2)
    assert ms(d, "backward") == pytest.approx(3)


def test_kept_packs_do_not_recompute_and_kinds_are_named() -> None:
    events = [
        ev("dev0:compute", "efwd", 0, 2),
        ev("dev0:compute", "head/0", 2, 3),
        ev("dev0:compute", "bwd/1/0", 5, 10),  # pack 1 keeps its activations
        ev("dev0:compute", "bwd/0/0", 15, 10),
        ev("dev0:compute", "ebwd", 25, 1),
    ]
    d = decompose(events, 0.026, recompute_share=0.5, recomputes=(True, False))
    assert ms(d, "forward") == pytest.approx(2)
    assert ms(d, "head") == pytest.approx(3)
    assert ms(d, "recompute") == pytest.approx(5)
    assert ms(d, "backward") == pytest.approx(10 + 5 + 1)


def test_events_outside_the_step_are_clipped() -> None:
    """A deferred optimizer pass begun in the last step and device spans past the step's end."""
    events = [ev("host:deferred-optimizer", "upd/L3 (last step's, clipped)", -20, 30),
              ev("dev0:compute", "fwd/0/0", 10, 100)]
    d = decompose(events, 0.050)
    assert ms(d, "exposed optimizer") == pytest.approx(10)
    assert ms(d, "forward") == pytest.approx(40)
    assert sum(d["parts"].values()) == pytest.approx(0.050, abs=1e-12)


def test_rejects_a_non_positive_step_and_malformed_spans() -> None:
    with pytest.raises(ValueError):
        decompose([], 0.0)
    with pytest.raises(ValueError):
        Span(0.0, 1.0, "compute", {"forward": 0.5})  # fractions not summing to 1
    with pytest.raises(ValueError):
        Span(0.0, 1.0, "compute", {"bogus": 1.0})
    with pytest.raises(ValueError):
        Span(0.0, 1.0, "gpu")


def test_spans_directly() -> None:
    """The arithmetic without the engine's names: a compute span split 70/30 under an optimizer
    span that sticks out 2 s; two uploads overlapping while nothing computes count once."""
    d = decompose_spans([Span(0, 10, "compute", {"backward": 0.7, "recompute": 0.3}),
                         Span(5, 12, "optimizer"), Span(14, 16, "upload"), Span(15, 17, "upload")], 20.0)
    assert d["parts"]["backward"] == pytest.approx(7) and d["parts"]["recompute"] == pytest.approx(3)
    assert d["parts"]["exposed optimizer"] == pytest.approx(2)
    assert d["parts"]["exposed upload"] == pytest.approx(3)
    assert d["parts"]["idle"] == pytest.approx(5)


_LANES = ("dev0:compute", "dev1:compute", "dev0:h2d", "dev1:d2h", "host:optimizer", "dev0:collective")


@st.composite
def timelines(draw) -> tuple[list[dict], float]:
    step = draw(st.floats(1.0, 100.0))
    events = []
    for _ in range(draw(st.integers(0, 25))):
        lane = draw(st.sampled_from(_LANES))
        name = draw(st.sampled_from(("fwd/0/0", "bwd/2/1", "head/0", "ebwd"))) if "compute" in lane else "x"
        start = draw(st.floats(-10.0, 110.0))
        events.append(ev(lane, name, start, draw(st.floats(0.0, 50.0))))
    return events, step * 1e-3


def _clipped(iv: list[tuple[float, float]], step_us: float) -> list[tuple[float, float]]:
    return [(max(0.0, a), min(step_us, b)) for a, b in iv if min(step_us, b) > max(0.0, a)]


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of a's union not covered by b's union (both merged and sorted)."""
    tot = sum(y - x for x, y in a)
    for x, y in a:
        for u, v in b:
            tot -= max(0.0, min(y, v) - max(x, u))
    return tot


@settings(max_examples=200, deadline=None)
@given(timelines(), st.floats(0.0, 1.0))
def test_parts_sum_to_the_step_and_match_interval_algebra(tl: tuple[list[dict], float], share: float) -> None:
    events, step = tl
    d = decompose(events, step, recompute_share=share)
    parts = d["parts"]
    assert set(parts) == set(PARTS) and all(v >= -1e-12 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(step, rel=1e-9, abs=1e-12)
    step_us = step * 1e6
    busy = {lane: _clipped(iv, step_us) for lane, iv in lane_busy(events).items()}
    spans = [{"lane": "c", "start_us": a, "dur_us": b - a}
             for lane, iv in busy.items() if lane.endswith(":compute") for a, b in iv]
    compute = lane_busy(spans).get("c", [])
    compute_s = sum(parts[p] for p in COMPUTE_PARTS)
    assert compute_s * 1e6 == pytest.approx(sum(b - a for a, b in compute), abs=1e-6)
    uploads = busy.get("dev0:h2d", [])
    assert d["exposed_any"]["upload"] * 1e6 == pytest.approx(_minus(uploads, compute), abs=1e-6)
    assert parts["exposed upload"] == pytest.approx(d["exposed_any"]["upload"], abs=1e-12)


def test_phases_and_their_predicted_names() -> None:
    events = [
        ev("dev0:h2d", "ru/E", 0, 3),
        ev("dev0:compute", "efwd", 3, 1),
        ev("dev0:compute", "fwd/0/0", 4, 10),
        ev("dev0:compute", "head/0", 14, 2),
        ev("dev0:compute", "bwd/0/0", 16, 20),
        ev("dev0:compute", "ebwd", 36, 2),
        ev("host:optimizer", "upd/L0", 38, 5),
    ]
    p = phases(events, 0.045)
    assert {k: round(v * 1e3, 9) for k, v in p.items()} == {"fill": 4, "forward": 10, "head + backward": 24,
                                                            "tail": 7, "head tasks": 2}
    assert phases(events[:3], 0.045) == {}


def test_predicted_phases_of_a_real_prediction() -> None:
    from tinypipe.planner.cost import predict_step_time
    from tinypipe.planner.auto import CPU_HARDWARE
    from tinypipe.planner.sizes import model_sizes
    from benchkit.workloads import WORKLOADS
    from tinypipe.schedule.plan import make_plan

    import transformers

    w = WORKLOADS["tiny"]
    sizes = model_sizes(transformers.LlamaConfig(**w.config))
    plan = make_plan(sizes.num_blocks, pack_size=1, micro_batch_size=2, backward_micro_batch_size=2,
                     num_devices=1, prefetch_window=1, stash="device", tied=True)
    t = predict_step_time(sizes, plan, CPU_HARDWARE, batch=w.batch, seq=w.seq, precision="fp32")
    p = predicted_phases(t)
    assert sum(v for k, v in p.items() if k != "head tasks") == pytest.approx(t.step_s)


def _hw(profile: LayerProfile | None) -> HardwareSpec:
    from dataclasses import replace

    from tinypipe.planner.auto import CPU_HARDWARE

    return replace(CPU_HARDWARE, layer_profile=profile)


def test_recompute_share_follows_the_time_model() -> None:
    assert recompute_share(_hw(None), "bf16", 2048, 8192) == pytest.approx(1 / 3)
    assert recompute_share(_hw(None), "bf16", 2048, 8192, lora=True) == pytest.approx(1 / 2)
    # a profile where the recompute ran at half the backward's rate: F/r over F/r + 2F/(2r) = 1/2
    pt = ProfilePoint(seq=2048, micro_batch=4, forward_s=1.0, recompute_s=2.0, backward_s=2.0, head_s=0.1)
    prof = LayerProfile("bf16", block_params=10**6, attn_width=128, head_params=10**6, points=(pt,))
    assert recompute_share(_hw(prof), "bf16", 2048, 8192) == pytest.approx(1 / 2)
    assert recompute_share(_hw(prof), "fp32", 2048, 8192) == pytest.approx(1 / 3)  # other precision


def test_a_real_engine_step_decomposes() -> None:
    """The tiny workload's step on the CPU: the parts sum to the step's measured time and the
    compute parts to the compute lane's busy time."""
    import tinypipe
    from benchkit.workloads import WORKLOADS, build_model, make_batch

    w = WORKLOADS["tiny"]
    torch.manual_seed(0)
    model = build_model(w)
    cfg = tinypipe.Config(devices=["cpu"], precision="fp32", lr=1e-5, pack_size=2, micro_batch_size=4,
                          backward_micro_batch_size=4)
    engine = tinypipe.Engine(model, cfg)
    try:
        r = engine.step(make_batch(w))
        events = engine.step_timeline()
    finally:
        engine.close()
    d = decompose(events, r.seconds, recompute_share=1 / 3)
    assert sum(d["parts"].values()) == pytest.approx(r.seconds, rel=1e-9)
    compute = lane_busy([e for e in events if e["lane"] == "dev0:compute"])["dev0:compute"]
    compute = _clipped(compute, r.seconds * 1e6)
    assert sum(d["parts"][p] for p in COMPUTE_PARTS) * 1e6 == pytest.approx(sum(b - a for a, b in compute),
                                                                           rel=1e-6)
    assert d["parts"]["recompute"] == pytest.approx(d["parts"]["backward"] * 0.5, rel=0.2)  # ebwd is small
    assert not math.isnan(sum(phases(events, r.seconds).values()))
