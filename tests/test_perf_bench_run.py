"""bench/run.py end to end on the CPU with the tiny workload (what the lead runs on the GPU with W1/W3):
the JSON keeps the bound's old keys and adds the recompute variants and the memory limit, and the
last step's decomposition sums to that step's measured time, printed as a table beside the
prediction's phases."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "run.py"


def test_tiny_run_records_bound_and_decomposition(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    spec = importlib.util.spec_from_file_location("bench_run", BENCH)
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    out = tmp_path / "run.json"
    assert bench.main(["tiny", "--devices", "cpu", "--precision", "fp32", "--warmup", "1", "--steps", "1",
                       "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    bound = rec["bound"]
    for key in ("compute", "upload", "download", "cpu optimizer", "bound_s", "compute_no_recompute",
                "ceiling_s", "recompute_fraction", "forced_recompute_fraction"):
        assert key in bound
    assert bound["recompute_fraction"] == 1.0  # every pack recomputes in the hand-set plan
    assert bound["keep_limit"]["budget_bytes"] is None  # a CPU device: nothing forces recompute
    assert bound["keep_limit"]["forced_blocks"] == 0 and bound["forced_recompute_fraction"] == 0.0
    dec = rec["decomposition"]
    assert dec["step_s"] == rec["steps_s"][-1]
    assert sum(dec["parts"].values()) == pytest.approx(dec["step_s"], rel=1e-9)
    assert dec["parts"]["recompute"] > 0 and dec["recompute_split"] == "modelled"
    assert dec["times"] == "host" and set(dec["phases"]) == set(dec["predicted_phases"])
    printed = capsys.readouterr().out
    assert "step decomposition (last step" in printed and "| exposed upload |" in printed
    assert "phases vs the time model's prediction" in printed
    off = bound["offload_limit"]  # what offloading instead of recomputing could save in this step
    assert 0 <= off["saved_s"] <= dec["parts"]["recompute"] + 1e-12 and off["bytes_per_block"] > 0
    assert "offloading activations instead of recomputing" in printed


@pytest.mark.parametrize("clip", [None, "1e-3"])
def test_tiny_run_with_every_second_block_assisted(tmp_path: Path, clip: str | None) -> None:
    """``--assist-every 2`` runs the engine's plan with blocks 2, 4, ... assisted (without clipping
    stepped after their backward, with clipping at their next upload) and records it."""
    spec = importlib.util.spec_from_file_location("bench_run", BENCH)
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    out = tmp_path / "run.json"
    args = ["tiny", "--devices", "cpu", "--precision", "fp32", "--warmup", "1", "--steps", "2",
            "--assist-every", "2", "--json", str(out)]
    assert bench.main(args + (["--max-grad-norm", clip] if clip else [])) == 0
    rec = json.loads(out.read_text())
    blocks = sum(len(p) for p in rec["plan"]["packs"])
    assert rec["plan"]["assisted"] == list(range(2, blocks + 1, 2))
    assert len(rec["losses"]) == 3 and all(loss == loss for loss in rec["losses"])
    dram = rec["bound"].get("clipped_dram")
    if clip is None:
        assert dram is None
    else:  # the forward after a clipped step: its host traffic (no DRAM rate for a CPU device)
        assert dram["assisted"] > 0 and dram["host_stepped"] > 0
        assert dram["bytes"] >= 32 * dram["host_stepped"] + 28 * dram["assisted"]
        assert dram["floor_s"] is None or dram["floor_s"] > 0


def test_plan_file_reruns_a_measured_plan(tmp_path: Path) -> None:
    """``--plan`` takes a run's JSON result (or a Plan JSON) and runs exactly that plan, with the
    same losses as the run that recorded it: a plan measured before a runtime change can be
    measured again after it."""
    spec = importlib.util.spec_from_file_location("bench_run", BENCH)
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    first, again, again_plan = tmp_path / "first.json", tmp_path / "again.json", tmp_path / "again_plan.json"
    common = ["tiny", "--devices", "cpu", "--precision", "fp32", "--warmup", "1", "--steps", "1"]
    assert bench.main(common + ["--pack-size", "2", "--assist-every", "2", "--max-grad-norm", "1e-3",
                                "--json", str(first)]) == 0
    rec = json.loads(first.read_text())
    assert rec["plan"]["assisted"] and len(rec["plan"]["packs"][0]) == 2  # not the default plan
    assert bench.main(common + ["--max-grad-norm", "1e-3", "--plan", str(first), "--json", str(again)]) == 0
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(rec["plan"]))
    assert bench.main(common + ["--max-grad-norm", "1e-3", "--plan", str(plan_file), "--json",
                                str(again_plan)]) == 0
    for path in (again, again_plan):
        out = json.loads(path.read_text())
        assert out["plan"] == rec["plan"]
        assert out["losses"] == rec["losses"]
