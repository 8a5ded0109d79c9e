"""The measured recompute sub-span: a traced step records, inside each recomputing backward task, the
span of its recompute as its own timeline event (``<bwd id>/recompute`` on the task's lane) and in
the Chrome trace; kept packs and untraced steps record none; bench/decompose.py then takes the
recompute from those spans instead of the time model's share (hand-built timelines, random ones,
real CPU steps, bench/run.py end to end; a CUDA step where a GPU is present)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinypipe
from benchkit.analysis import lane_busy
from benchkit.step_parts import COMPUTE_PARTS
from model_zoo import make_batch, make_model
from tinypipe.schedule.ids import Kind

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


DEC = _bench_module("decompose")

# 6 blocks in 3 packs, the first resident: packs 0 and 2 keep their activations, pack 1 recomputes
KEPT = dict(pack_size=2, micro_batch_size=2, resident_packs=1, keep_activations=[True, False, True])


def ev(lane: str, name: str, start_ms: float, dur_ms: float, parent: str | None = None) -> dict:
    e = {"lane": lane, "name": name, "start_us": start_ms * 1e3, "dur_us": dur_ms * 1e3}
    return e if parent is None else e | {"parent": parent}


def ms(d: dict, part: str) -> float:
    return d["parts"][part] * 1e3


def _step(trace: bool, devices: list[str], **cfg) -> tuple[tinypipe.Engine, tinypipe.StepResult]:
    torch.manual_seed(0)
    eng = tinypipe.Engine(make_model("gpt2", layers=6),
                          tinypipe.Config(devices=devices, trace=trace, **KEPT, **cfg))
    return eng, eng.step(make_batch(5, 8))


def _recomputing_bwd(eng: tinypipe.Engine, batch: int) -> list[str]:
    """The recomputing backward tasks' ids as the timeline names them."""
    sched = eng.schedule_for(batch)
    return sorted(str(t) for t, task in sched.tasks.items()
                  if task.kind is Kind.BWD and not eng.plan.kept(task.pack))


def _check_nested(events: list[dict], recomputing: list[str]) -> None:
    """One sub-span per recomputing backward task, on its lane, inside its span; the tasks as before."""
    tasks = {e["name"]: e for e in events if "parent" not in e}
    subs = [e for e in events if "parent" in e]
    assert sorted(e["parent"] for e in subs) == recomputing
    for s in subs:
        t = tasks[s["parent"]]
        assert s["name"] == f"{s['parent']}/recompute" and s["lane"] == t["lane"]
        assert t["start_us"] <= s["start_us"] and s["dur_us"] > 0
        assert s["start_us"] + s["dur_us"] <= t["start_us"] + t["dur_us"] + 1e-3  # device times: float


def test_traced_cpu_step_records_one_sub_span_per_recomputing_backward() -> None:
    eng, r = _step(True, ["cpu"])
    try:
        assert eng.plan.keep_activations == (True, False, True)
        events = eng.step_timeline()
        recomputing = _recomputing_bwd(eng, 5)
        assert recomputing and all(t.startswith("bwd/1/") for t in recomputing)  # none of the kept packs
        _check_nested(events, recomputing)
        names = sorted(e["name"] for e in events if "parent" not in e)
        assert names == sorted(map(str, eng.schedule_for(5).tasks))
        assert sum(t.parent is not None for t in r.timings) == len(recomputing)

        d = DEC.step_decomposition(events, r.seconds, recompute_share=0.9,
                                   recomputes=DEC.pack_recomputes(eng.plan))
        assert d["recompute_measured"] and d["recompute_spans"] == len(recomputing)
        assert sum(d["parts"].values()) == pytest.approx(r.seconds, rel=1e-9)
        sub_s = sum(e["dur_us"] for e in events if "parent" in e) / 1e6
        assert d["parts"]["recompute"] == pytest.approx(sub_s, rel=1e-9)  # one device: nothing shared
        bwd_s = sum(e["dur_us"] for e in events if e["name"].startswith(("bwd/", "ebwd"))
                    and "parent" not in e) / 1e6
        assert d["parts"]["backward"] == pytest.approx(bwd_s - sub_s, rel=1e-9)
        compute = lane_busy([e for e in events if e["lane"] == "dev0:compute"])["dev0:compute"]
        busy = sum(min(b, r.seconds * 1e6) - max(a, 0.0) for a, b in compute if b > 0) / 1e6
        assert sum(d["parts"][p] for p in COMPUTE_PARTS) == pytest.approx(busy, rel=1e-6)
    finally:
        eng.close()


def test_untraced_step_records_no_sub_span_and_the_split_is_modelled() -> None:
    eng, r = _step(False, ["cpu"])
    try:
        events = eng.step_timeline()
        assert all("parent" not in e and "/recompute" not in e["name"] for e in events)
        assert all(t.parent is None and t.events is None for t in r.timings)
        assert len(r.timings) == len(eng.schedule_for(5).tasks)
        d = DEC.step_decomposition(events, r.seconds, recompute_share=0.25,
                                   recomputes=DEC.pack_recomputes(eng.plan))
        assert not d["recompute_measured"] and d["recompute_spans"] == 0
        bwd1_s = sum(e["dur_us"] for e in events if e["name"].startswith("bwd/1/")) / 1e6
        assert d["parts"]["recompute"] == pytest.approx(0.25 * bwd1_s, rel=1e-9)
    finally:
        eng.close()


def test_trace_file_holds_the_sub_spans_nested_in_their_tasks(tmp_path: Path) -> None:
    eng, _ = _step(True, ["cpu", "cpu"])
    try:
        recomputing = _recomputing_bwd(eng, 5)
        events = json.loads(eng.export_trace(tmp_path / "t.json").read_text())["traceEvents"]
    finally:
        eng.close()
    xs = [e for e in events if e["ph"] == "X"]
    by_name = {e["name"]: e for e in xs}
    subs = sorted(e["name"] for e in xs if e["name"].endswith("/recompute"))
    assert subs == [f"{t}/recompute" for t in recomputing]
    for name in subs:
        s, t = by_name[name], by_name[name.removesuffix("/recompute")]
        assert s["tid"] == t["tid"] and t["ts"] <= s["ts"]
        assert s["ts"] + s["dur"] <= t["ts"] + t["dur"] + 0.002  # rounded to 0.001 us each


def test_hand_built_measured_spans() -> None:
    """A bwd task of 10 ms recomputing 2..5 ms: 3 ms recompute, 7 backward whatever the share; a bwd
    task without a sub-span (a kept pack) is all backward; sub-spans are no compute of their own."""
    events = [
        ev("dev0:compute", "fwd/0/0", 0, 4),
        ev("dev0:compute", "bwd/0/0/recompute", 6, 3, parent="bwd/0/0"),
        ev("dev0:compute", "bwd/0/0", 4, 10),
        ev("dev0:compute", "bwd/1/0", 14, 6),  # kept: no sub-span
        ev("dev0:h2d", "up/b0/L1", 18, 6),
    ]
    d = DEC.step_decomposition(events, 0.026, recompute_share=0.5)
    assert d["recompute_measured"] and d["recompute_spans"] == 1 and d["recompute_share"] == 0.5
    assert ms(d, "forward") == pytest.approx(4)
    assert ms(d, "recompute") == pytest.approx(3)
    assert ms(d, "backward") == pytest.approx(7 + 6)
    assert ms(d, "exposed upload") == pytest.approx(4) and ms(d, "idle") == pytest.approx(2)
    assert sum(d["parts"].values()) == pytest.approx(0.026, abs=1e-12)
    # the same timeline without the sub-span: the modelled share, on every recomputing pack
    d = DEC.step_decomposition([e for e in events if "parent" not in e], 0.026, recompute_share=0.5,
                               recomputes=(True, False))
    assert not d["recompute_measured"] and ms(d, "recompute") == pytest.approx(5)
    assert ms(d, "backward") == pytest.approx(5 + 6)


def test_measured_spans_share_instants_with_other_devices_and_are_clipped() -> None:
    """dev0's bwd recomputes 0..4 of its 0..10 while dev1 runs a forward 0..10: each instant is
    shared -- recompute 2, backward 3, forward 5; a sub-span sticking out of its task (clock skew)
    counts only inside it, and several sub-spans in one task all count."""
    events = [ev("dev0:compute", "bwd/0/0/recompute", -1, 5, parent="bwd/0/0"),
              ev("dev0:compute", "bwd/0/0", 0, 10), ev("dev1:compute", "fwd/1/0", 0, 10)]
    d = DEC.step_decomposition(events, 0.010)
    assert ms(d, "recompute") == pytest.approx(2) and ms(d, "backward") == pytest.approx(3)
    assert ms(d, "forward") == pytest.approx(5)
    events = [ev("dev0:compute", "bwd/0/0", 0, 10), ev("dev0:compute", "bwd/0/0/recompute", 7, 5, "bwd/0/0"),
              ev("dev0:compute", "bwd/0/0/recompute", 1, 2, "bwd/0/0")]
    d = DEC.step_decomposition(events, 0.012)
    assert ms(d, "recompute") == pytest.approx(2 + 3) and ms(d, "backward") == pytest.approx(5)
    assert ms(d, "idle") == pytest.approx(2) and d["recompute_spans"] == 2
    assert DEC.phases(events, 0.012) == {}  # no forward / head: sub-spans are no tasks of their own


@st.composite
def timelines(draw) -> tuple[list[dict], float]:
    """Non-overlapping tasks per compute lane, some bwd tasks with sub-spans inside, plus transfers."""
    events = []
    for lane in ("dev0:compute", "dev1:compute"):
        t = draw(st.floats(-5.0, 20.0))
        for i in range(draw(st.integers(0, 6))):
            dur = draw(st.floats(0.0, 20.0))
            name = draw(st.sampled_from(("fwd/0/0", "head/0", "ebwd", f"bwd/{lane[3]}/{i}")))
            events.append(ev(lane, name, t, dur))
            if name.startswith("bwd/") and draw(st.booleans()):
                a = draw(st.floats(0.0, 1.0)) * dur
                b = draw(st.floats(0.0, 1.0)) * (dur - a)
                events.append(ev(lane, f"{name}/recompute", t + a, b, name))
            t += dur + draw(st.floats(0.0, 5.0))
    for lane in ("dev0:h2d", "host:optimizer"):
        for _ in range(draw(st.integers(0, 4))):
            events.append(ev(lane, "x", draw(st.floats(-5.0, 100.0)), draw(st.floats(0.0, 30.0))))
    return events, draw(st.floats(1.0, 100.0)) * 1e-3


@settings(max_examples=150, deadline=None)
@given(timelines())
def test_random_timelines_with_sub_spans_sum_to_the_step(tl: tuple[list[dict], float]) -> None:
    events, step = tl
    d = DEC.step_decomposition(events, step, recompute_share=0.7)
    parts = d["parts"]
    assert all(v >= -1e-12 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(step, rel=1e-9, abs=1e-12)
    tasks = [e for e in events if "parent" not in e]
    reordered = DEC.step_decomposition(events[::-1], step, recompute_share=0.7)  # sub-spans first
    assert parts == pytest.approx(reordered["parts"], rel=1e-9, abs=1e-12)
    step_us = step * 1e6
    compute = lane_busy([{"lane": "c", "start_us": e["start_us"], "dur_us": e["dur_us"]}
                         for e in tasks if e["lane"].endswith(":compute")]).get("c", [])
    busy = sum(max(0.0, min(b, step_us) - max(a, 0.0)) for a, b in compute) / 1e6
    assert sum(parts[p] for p in COMPUTE_PARTS) == pytest.approx(busy, rel=1e-9, abs=1e-12)
    assert d["recompute_measured"] == any("parent" in e for e in events)
    if d["recompute_measured"]:  # instants may be shared with the other device: at most the sub-spans
        assert parts["recompute"] <= sum(e["dur_us"] for e in events if "parent" in e) / 1e6 + 1e-12


def test_bench_run_traced_says_measured(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bench = _bench_module("run")
    out = tmp_path / "run.json"
    assert bench.main(["tiny", "--devices", "cpu", "--precision", "fp32", "--warmup", "0", "--steps", "1",
                       "--json", str(out), "--trace", str(tmp_path / "t.json")]) == 0
    dec = json.loads(out.read_text())["decomposition"]
    assert dec["recompute_measured"] and dec["recompute_split"] == "measured" and dec["recompute_spans"] > 0
    assert dec["parts"]["recompute"] > 0
    assert sum(dec["parts"].values()) == pytest.approx(dec["step_s"], rel=1e-9)
    printed = capsys.readouterr().out
    n = dec["recompute_spans"]
    assert f"recompute = the {n} recompute sub-spans of the bwd tasks, measured" in printed
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sum(e["name"].endswith("/recompute") for e in trace) == dec["recompute_spans"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_traced_cuda_step_sub_spans_are_device_timed_inside_their_tasks() -> None:
    eng, r = _step(True, ["cuda:0"])
    try:
        recomputing = _recomputing_bwd(eng, 5)
        assert all(t.events is not None for t in r.timings if t.parent is not None)
        _check_nested(eng.step_timeline(), recomputing)
    finally:
        eng.close()
