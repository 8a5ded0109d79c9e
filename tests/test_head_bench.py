"""bench/head_bench.py runs end to end on the CPU with its tiny shapes (what the lead runs on the
GPU with W1 and W3): every path, a JSON row per path, the table last -- and the eager path at the
old chunk gives bit for bit what the head before the fused loss gave."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "head_bench.py"


def test_small_run_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("head_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "head_bench", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    out = tmp_path / "head.json"
    # the compiled path is tests/test_head_loss.py's (it costs a C++ compile per chunk shape)
    assert bench.main(["--small", "--device", "cpu", "--reps", "1", "--no-fused", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["path"]) for r in rows] == [
        (w, p) for w in ("W1-small", "W3-small") for p in ("old", "eager@old", "eager", "matmuls")]
    for r in rows:
        assert r["seconds"] > 0
        if r["path"] == "eager@old":
            assert all(r[k] == 0.0 for k in ("loss_rel", "dx_abs", "dnorm_abs", "dw_abs")), r
        if r["path"] == "eager":  # twice the tokens per chunk, the planner's bound no larger -- but for
            # the allocator's rounding (2 x 2 MiB) and the per-token vectors the old bound lacked
            old = next(o for o in rows if o["workload"] == r["workload"] and o["path"] == "old")
            slack = 4 * 2**20 + 24 * r["chunk"]
            assert r["chunk"] == 2 * old["chunk"] and r["planner_bound_bytes"] <= old["planner_bound_bytes"] + slack
            assert r["loss_rel"] < 1e-6 and r["dx_abs"] == 0.0
    text = capsys.readouterr().out
    assert text.rstrip().splitlines()[-1].startswith("W3-small  matmuls")
