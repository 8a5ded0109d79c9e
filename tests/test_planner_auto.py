"""Issue #4: the profiler (`tinypipe profile`, measured per-layer times in the cost model), the
engine planning for itself when no packing knob is set, and the GPU validation script's logic."""

from __future__ import annotations

import dataclasses

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

import tinypipe
from model_zoo import make_batch, make_model
from tinypipe import cli
from tinypipe.errors import ConfigError, PlanDoesNotFitError
from tinypipe.planner.auto import resolve_plan
from tinypipe.planner.hardware import HARDWARE, load_hardware
from tinypipe.planner.layer_profile import LayerProfile, ProfilePoint
from tinypipe.planner.search import evaluate, plan_for
from tinypipe.planner.sizes import model_sizes
from tinypipe.schedule.plan import make_plan

GIB = 1024**3
ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- profile


def _synthetic(scale: float = 1.0) -> LayerProfile:
    pts = []
    for seq in (1024, 2048):
        for mb in (1, 2, 4):
            t = seq * mb
            base = scale * 1e-3 * t / 1024 * (1.2 if mb == 1 else 1.0)
            pts.append(ProfilePoint(seq, mb, base, base * 1.05, 2.1 * base, base / 4))
    return LayerProfile("bf16", 100_000_000, 3072, 400_000_000, tuple(pts))


def test_layer_profile_reproduces_and_interpolates() -> None:
    prof = _synthetic()
    for p in prof.points:  # at the grid: the measured times
        for kind, t in (("forward", p.forward_s), ("recompute", p.recompute_s), ("backward", p.backward_s)):
            got = prof.block_time(kind, block_params=prof.block_params, attn_width=prof.attn_width, seq=p.seq,
                                  micro_batch=p.micro_batch)
            assert got == pytest.approx(t, rel=1e-9)
    # between seq lengths: between the neighbours' rates; beyond the largest micro-batch: rate held
    r1, r2 = prof.rate("forward", 1024, 4096), prof.rate("forward", 2048, 8192)
    assert min(r1, r2) * 0.999 <= prof.rate("forward", 1448, 6000) <= max(r1, r2) * 1.001
    assert prof.rate("forward", 2048, 1 << 20) == pytest.approx(prof.rate("forward", 2048, 8192))
    assert prof.rate("forward", 1024, 256) < prof.rate("forward", 1024, 1024)  # falls off below the grid
    assert LayerProfile.from_dict(json.loads(json.dumps(prof.as_dict()))) == prof


def test_cost_model_uses_measured_times() -> None:
    sizes = model_sizes(transformers.LlamaConfig(hidden_size=3072, num_hidden_layers=28,
                                                 intermediate_size=8192,
                                                 num_attention_heads=24, num_key_value_heads=8,
                                                 vocab_size=128256,
                                                 tie_word_embeddings=True, max_position_embeddings=8192))
    base = HARDWARE["h200-pcie5"]
    plan = make_plan(sizes.num_blocks, pack_size=2, micro_batch_size=4, backward_micro_batch_size=4,
                     num_devices=1, prefetch_window=2, stash="host", tied=sizes.tied)
    kw = dict(seq=2048, global_batch=16, precision="bf16")
    from dataclasses import replace

    fast = evaluate(sizes, replace(base, layer_profile=_synthetic(1.0)), plan, **kw).time
    slow = evaluate(sizes, replace(base, layer_profile=_synthetic(4.0)), plan, **kw).time
    assert slow.compute_s == pytest.approx(4 * fast.compute_s, rel=0.05)  # 4x slower blocks and head
    other = evaluate(sizes, replace(base, layer_profile=replace(_synthetic(4.0), precision="fp32")), plan,
                     **kw).time
    assert other.compute_s == pytest.approx(evaluate(sizes, base, plan,
                                                     **kw).time.compute_s)  # other precision: FLOPs


def test_profile_command_on_cpu_feeds_plan(tmp_path: Path, capsys) -> None:
    model_dir = tmp_path / "tiny"
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512,
                             max_position_embeddings=128).save_pretrained(model_dir)
    out = tmp_path / "profile.json"
    rc = cli.main(["profile", "--device", "cpu", "--model", str(model_dir), "--seq-lens", "16,32",
                   "--micro-batches", "1,2", "--reps", "1", "--output", str(out)])
    assert rc == 0, capsys.readouterr().err
    d = json.loads(out.read_text())
    assert d["format"] == "tinypipe-profile" and d["precision"] == "fp32"
    assert len(d["layer_profile"]["points"]) == 4 and all(p["act_saved_bytes"] > 0 for p in d["points"])
    assert d["h2d_gbs"] > 0 and d["cpu_adamw_gparams_s"] > 0 and d["model"]["block_param_bytes"] > 0
    hw = load_hardware(str(out))
    assert hw.layer_profile is not None and hw.layer_profile.precision == "fp32"
    result = plan_for(str(model_dir), str(out), gpus=1, gpu_memory_bytes=GIB, cpu_memory_bytes=8 * GIB,
                      seq=32, global_batch=4, precision="fp32")
    assert any("measured per-layer" in n for n in result.notes)
    # the predicted compute of a one-block-per-pack plan is built from the measured block times
    p = hw.layer_profile
    plan = make_plan(result.sizes.num_blocks, pack_size=1, micro_batch_size=2, backward_micro_batch_size=2,
                     num_devices=1, prefetch_window=1, stash="device", tied=result.sizes.tied)
    c = evaluate(result.sizes, hw, plan, seq=32, global_batch=4, precision="fp32")
    pt = next(x for x in p.points if x.seq == 32 and x.micro_batch == 2)
    blocks = 4 * 2 * (pt.forward_s + pt.recompute_s + pt.backward_s)  # 4 blocks x 2 micro-batches
    assert c.time.compute_s > blocks
    assert c.time.compute_s < blocks + 1.0
    # plan --hardware FILE
    assert cli.main(["plan", "--model", str(model_dir), "--hardware", str(out), "--seq-len", "32",
                     "--global-batch", "4", "--cpu-memory", "8GiB", "--gpu-memory", "1GiB",
                     "--precision", "fp32"]) == 0
    assert "measured per-layer" in capsys.readouterr().out


def test_profile_bad_input_is_one_line(tmp_path: Path, capsys) -> None:
    assert cli.main(["profile", "--device", "cpu", "--seq-lens", "0", "--output",
                     str(tmp_path / "p.json")]) == 2
    assert "seq-lens" in capsys.readouterr().err


# --------------------------------------------------------------------------- engine plans for itself


def test_unset_knobs_mean_automatic_plan() -> None:
    assert tinypipe.Config().auto_plan
    assert not tinypipe.Config(micro_batch_size=2).auto_plan
    filled = tinypipe.Config(micro_batch_size=2).plan_settings()
    assert filled == dict(pack_size=1, micro_batch_size=2, backward_micro_batch_size=2, prefetch_window=1,
                          stash="device", grad_slots=None, device_optimizer="off", resident_packs=0)
    assert tinypipe.Config(gpu_memory_bytes="2GiB").gpu_memory_bytes == 2 * GIB
    with pytest.raises(ConfigError):
        tinypipe.Config(seq_len=1)


def test_engine_plans_when_no_knob_is_set() -> None:
    model = make_model("llama", layers=4)
    cfg = tinypipe.Config(devices=["cpu"], seq_len=16, global_batch=4, gpu_memory_bytes="2GiB",
                          cpu_memory_bytes="16GiB", lr=1e-3)
    eng = tinypipe.Engine(model, cfg)
    assert eng.plan_result is not None
    assert eng.plan is eng.plan_result.best.plan  # the planner's plan runs as it is
    assert eng.config is cfg and eng.config.auto_plan  # the config stays as given
    r = eng.step(make_batch(4, 16))
    assert r.loss == r.loss
    eng.close()


def test_engine_refuses_when_nothing_fits() -> None:
    cfg = tinypipe.Config(devices=["cpu"], seq_len=16, global_batch=4, gpu_memory_bytes=1024**2,
                          cpu_memory_bytes="16GiB")
    with pytest.raises(PlanDoesNotFitError) as e:
        tinypipe.Engine(make_model("llama", layers=4), cfg)
    assert "\n" not in str(e.value) and "GPU memory" in str(e.value)
    with pytest.raises(PlanDoesNotFitError, match="host memory"):
        tinypipe.Engine(make_model("llama", layers=4), cfg.replace(gpu_memory_bytes=2 * GIB,
                                                                   cpu_memory_bytes=1024**2))


def test_hand_set_plan_kept_and_checked_only_with_a_workload() -> None:
    model = make_model("llama", layers=4)
    shape = dict(num_blocks=4, tied=False)
    cfg = tinypipe.Config(devices=["cpu"], pack_size=2, micro_batch_size=2, gpu_memory_bytes=1024**2)
    plan, result = resolve_plan(model, cfg, **shape)
    assert result is None and plan.pack_size == 2 and plan.micro_batch_size == 2 and plan.stash == "device"
    assert plan.backward_micro_batch_size == 2 and plan.packs == ((0, 1), (2, 3))
    with pytest.raises(PlanDoesNotFitError, match="this plan"):
        resolve_plan(model, cfg.replace(seq_len=16, global_batch=4), **shape)
    # a plan passed in runs as it is (not checked against the budgets), if it suits the model and devices
    assert resolve_plan(model, cfg.replace(seq_len=16, global_batch=4), plan=plan, **shape) == (plan, None)
    with pytest.raises(ConfigError, match="plan covers 4 blocks, the model has 6"):
        resolve_plan(model, cfg, num_blocks=6, tied=False, plan=plan)
    with pytest.raises(ConfigError, match="plan is for 1 devices, config lists 2"):
        resolve_plan(model, cfg.replace(devices=["cpu", "cpu"]), plan=plan, **shape)
    # no workload, CPU devices: the hand-set defaults, no planning
    plan, result = resolve_plan(model, tinypipe.Config(devices=["cpu"]), **shape)
    assert result is None and (plan.pack_size, plan.micro_batch_size, plan.prefetch_window) == (1, 1, 1)


def test_automatic_plan_on_cuda_needs_the_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="seq_len"):
        resolve_plan(make_model("llama", layers=2), tinypipe.Config(devices=["cuda:0"]), num_blocks=2,
                     tied=False)


# --------------------------------------------------------------------------- validation script


def test_validate_planner_script_logic_on_cpu(tmp_path: Path, capsys) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import validate_planner
    finally:
        sys.path.pop(0)
    out = tmp_path / "v.json"
    rc = validate_planner.main(["--workload", "tiny", "--device", "cpu", "--cap-gib", "2", "--cpu-memory",
                                "16GiB", "--plans", "3", "--warmup", "0", "--steps", "1", "--json", str(out),
                                "--compare-hardware", "h200-pcie5", "--watchdog", "0"])
    text = capsys.readouterr().out
    assert rc == 0, text
    d = json.loads(out.read_text())
    labels = [r["label"] for r in d["rows"]]
    assert labels[0] == "planner" and len(labels) == 5 and "uniform-1" in labels
    assert any(lb.startswith("mobius-") for lb in labels)
    assert len({json.dumps(r["measured"]["settings"], sort_keys=True) for r in d["rows"][:3]}) == 3
    assert all(r["measured"]["step_s"] > 0 for r in d["rows"])
    assert text.rstrip().splitlines()[-1].startswith("| ")


def test_h200_profile_predicts_the_recorded_runs() -> None:
    """The planner with the H200 profile (bench/results/h200_profile_w1.json) against the five W1
    plans measured with compiled blocks (bench/results/validate_planner_1.json): step time within
    15 %, peak allocated within 10 %, the GPU need (with headroom) at or above peak reserved."""
    import json
    from pathlib import Path

    import transformers

    from benchkit.workloads import WORKLOADS
    from tinypipe.planner.hardware import load_hardware
    from tinypipe.planner.search import evaluate
    from tinypipe.planner.sizes import model_sizes

    root = Path(__file__).resolve().parent.parent / "bench" / "results"
    w = WORKLOADS["W1"]
    sizes = model_sizes(transformers.LlamaConfig(**w.config))
    hw = load_hardware(str(root / "h200_profile_w1.json")).with_memory(24 * 2**30)
    assert hw.layer_profile is not None and hw.layer_profile.act_bytes_per_token
    rows = json.loads((root / "validate_planner_1.json").read_text())["rows"]
    assert len(rows) == 5
    for r in rows:
        m = r["measured"]
        plan = make_plan(sizes.num_blocks, num_devices=1, tied=sizes.tied, **m["knobs"])  # Config field names
        # as measured: one gradient accumulator more than the largest pack (Plan.grad_slot_count)
        plan = dataclasses.replace(plan, grad_slots=max(len(p) for p in plan.packs) + 1)
        c = evaluate(sizes, hw, plan, seq=w.seq, global_batch=w.batch)
        alloc = sum(c.memory.devices["0:cuda:0"].values())
        assert abs(c.time.step_s / m["step_s"] - 1) <= 0.15, (r["label"], c.time.step_s, m["step_s"])
        assert abs(alloc / m["peak_allocated"] - 1) <= 0.10, (r["label"], alloc, m["peak_allocated"])
        assert c.gpu_need >= m["peak_reserved"], (r["label"], c.gpu_need, m["peak_reserved"])


CLIPPED_FIT = ["s7_w1_clip_after.json", "s7_w1_clip_final.json", "s8_w1_clip_host_s8.json",
               "s9_w1_clip_s9.json", "s9_w1_clip_s9c.json"]
CLIPPED_CHECK = ["s7_w3_clip_after.json", "s7_w3_clip_final.json", "s8_w3_clip_host_s8.json",
                 "s9_w3_clip_s9.json", "s9_w3_clip_s9c.json"]


def _clipped_error(run: str) -> float:
    """Predicted / measured - 1 of a clipped H200 run's step, on the preset its plan was chosen with."""
    import json
    from pathlib import Path

    import transformers

    from benchkit.workloads import WORKLOADS
    from tinypipe.planner.hardware import load_hardware
    from tinypipe.planner.search import evaluate
    from tinypipe.planner.sizes import model_sizes
    from tinypipe.schedule.plan import Plan

    m = json.loads((Path(__file__).resolve().parent.parent / "bench" / "results" / run).read_text())
    assert m["config"]["max_grad_norm"] == "1.0" and m["clipped_steps"] == m["timed_steps"]
    w = WORKLOADS[m["workload"]]
    sizes = model_sizes(transformers.LlamaConfig(**w.config))
    plan = Plan.from_json(json.dumps(m["plan"]))
    c = evaluate(sizes, load_hardware("h200-pcie5"), plan, seq=w.seq, global_batch=w.batch, max_grad_norm=1.0)
    assert c.time.clipped_step_s > 1.05 * c.time.step_s  # clipping is the slower path
    return c.time.clipped_step_s / m["seconds_per_step"] - 1


def test_h200_preset_predicts_clipped_steps() -> None:
    """Steps where clipping triggers (random-init W1/W3 clip every step), measured on the H200 with
    the planner's own clipped plans (sessions 7-9): CLIPPED_ADAMW_EFFICIENCY was fitted on the
    W1 runs' median (bench/archive/refit_clipped.py), so that median is exact to 0.5 % and each W1 run
    within 5 % (two runs of one plan differ by 4.3 %); the W3 runs, another model and other plans,
    were not fitted on: each within 5 %."""
    import statistics

    fit = {run: _clipped_error(run) for run in CLIPPED_FIT}
    assert abs(statistics.median(fit.values())) <= 0.005, fit
    check = {run: _clipped_error(run) for run in CLIPPED_CHECK}
    assert all(abs(e) <= 0.05 for e in [*fit.values(), *check.values()]), (fit, check)
