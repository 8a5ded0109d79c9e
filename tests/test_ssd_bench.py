"""bench/ssd_w3.py runs end to end on the CPU with a tiny shape (what the lead runs on the GPU with W3):
moments on the SSD, masters added while the host budget is exceeded, one JSON record per run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "ssd_w3.py"


def test_dry_run_on_cpu_writes_its_record(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("ssd_w3", BENCH)
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    ssd, out = tmp_path / "ssd", tmp_path / "run.json"
    ssd.mkdir()
    # a budget just above the planner's process baseline: the blocks' masters must follow the moments
    assert bench.main(["--offload-dir", str(ssd), "--workload", "tiny", "--devices", "cpu", "--layers", "3",
                       "--batch", "2", "--seq", "32", "--warmup", "1", "--steps", "1", "--no-measure",
                       "--host-budget-gib", "3.005", "--max-grad-norm", "1.0", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    kinds = {k for _, k in rec["plan"]["offload"]}
    assert kinds == {"moments", "master", "grad"}  # (a tiny model: its staging slots outweigh its blocks)
    assert rec["host_need_estimate"] > 0 and rec["host_need_dram_only"] > 0
    assert len(rec["steps"]) == 2 and rec["steps"][1]["ssd_read_bytes"] > 0 and rec["tokens_per_s"] > 0
    assert rec["lane_busy_s"]["ssd:read"] > 0 and rec["bound_s"] > 0
    assert rec["memory_report"]["ssd"]["total"] > 0
    assert not list(ssd.iterdir())
