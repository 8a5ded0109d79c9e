"""bench/ssd_w3.py runs end to end on the CPU with a tiny shape (what the lead runs on the GPU with W3):
the planner's offload set for the host budget -- moments, retained gradients, then masters while it is
still exceeded -- for a list of batches in one call, one JSON record per batch, a measured-vs-predicted
table last, and no scratch left behind."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "ssd_w3.py"


def test_dry_run_on_cpu_writes_a_record_per_batch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    spec = importlib.util.spec_from_file_location("ssd_w3", BENCH)
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    ssd, out = tmp_path / "ssd", tmp_path / "out"
    ssd.mkdir()
    out.mkdir()
    # a budget 154 MiB above the planner's process baseline (the CPU entry's pools and its activations
    # are host memory too, ~108 MiB here): the blocks' masters must follow the moments
    # and gradients (16 blocks: fewer and the staging slots a master adds outweigh what it frees)
    assert bench.main(["--offload-dir", str(ssd), "--workload", "tiny", "--devices", "cpu", "--layers", "16",
                       "--batches", "2,3", "--seq", "32", "--warmup", "1", "--steps", "1", "--no-measure",
                       "--host-budget-gib", "3.15", "--max-grad-norm", "1.0", "--json-dir", str(out),
                       "--prefix", "run"]) == 0
    for batch in (2, 3):
        rec = json.loads((out / f"run_b{batch}.json").read_text())
        assert rec["batch"] == batch
        kinds = {k for _, k in rec["plan"]["offload"]}
        assert kinds == {"moments", "master", "grad"}
        assert 0 < rec["host_need_estimate"] <= 3.15 * 2**30 < rec["host_need_dram_only"]
        assert rec["predicted_step_s"] > 0 and rec["scratch_bytes"] > 0
        assert len(rec["steps"]) == 2 and rec["steps"][1]["ssd_read_bytes"] > 0 and rec["tokens_per_s"] > 0
        assert rec["lane_busy_s"]["ssd:read"] > 0 and rec["bound_s"] > 0
        assert rec["memory_report"]["ssd"]["total"] > 0
        # the engine's staging pools are what the planner counted
        assert rec["memory_report"]["host"]["ssd_staging_pool"] <= rec["host_need_estimate"]
    table = capsys.readouterr().out.split("=== measured vs predicted")[1].splitlines()
    assert [line.split()[0] for line in table[2:4]] == ["2", "3"]  # one row per batch, after the header
    assert not list(ssd.iterdir())
