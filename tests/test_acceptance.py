"""The GPU acceptance matrix's machinery (bench/acceptance.py) on the CPU: its checks fail what they
must, and a row runs end to end in a child process and is checked from its raw JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import acceptance  # noqa: E402

GiB = 1024**3


def _engine_record(**over: object) -> dict:
    rec = {"kind": "engine", "row": {"devices": ["cuda:0"]}, "plan": "pack 1", "losses": [12.0, 11.5, 11.0],
           "gpu_peak_reserved": 18 * GiB, "gpu_cap": 24 * GiB, "gpu_need": 20 * GiB, "host_peak": 40 * GiB,
           "host_need": 40 * GiB, "tokens_per_s": 20_000.0, "predicted_tokens_per_s": 21_000.0}
    rec.update(over)
    return rec


def _failed(rec: dict, baseline: dict | None = None) -> list[str]:
    return [c for c, ok, _ in acceptance.check("w1", rec, baseline or {}) if not ok]


def test_a_good_row_passes_and_each_defect_fails_its_check() -> None:
    assert _failed(_engine_record()) == []
    assert _failed(_engine_record(losses=[11.0, 11.5])) == ["loss finite, falls"]
    assert _failed(_engine_record(losses=[12.0, float("nan")])) == ["loss finite, falls"]
    assert _failed(_engine_record(gpu_peak_reserved=25 * GiB, gpu_need=26 * GiB)) == ["GPU peak <= cap"]
    assert _failed(_engine_record(gpu_peak_reserved=21 * GiB)) == ["GPU peak <= estimate"]
    assert _failed(_engine_record(host_peak=47 * GiB)) == ["host peak <= estimate+"]  # 40 * 1.1 + 2 = 46
    assert _failed(_engine_record(host_peak=45.9 * GiB)) == []
    assert _failed(_engine_record(predicted_tokens_per_s=23_100.0)) == ["prediction +-15 %"]
    assert _failed(_engine_record(predicted_tokens_per_s=None)) == ["prediction +-15 %"]
    base = {"w1": {"tokens_per_s": 22_500.0, "commit": "abc"}}
    assert _failed(_engine_record(), base) == ["speed >= 0.9 x baseline"]  # 20,000 < 0.9 x 22,500
    assert _failed(_engine_record(tokens_per_s=20_300.0), base) == []
    assert _failed({"kind": "engine", "error": "exit 1: OOM"}) == ["runs"]


def test_entries_on_one_gpu_are_checked_against_their_sum() -> None:
    rec = _engine_record(row={"devices": ["cuda:0", "cuda:0"]}, gpu_peak_reserved=21 * GiB, gpu_need=11 * GiB)
    assert _failed(rec) == []
    assert _failed(dict(rec, gpu_peak_reserved=23 * GiB)) == ["GPU peak <= estimate"]


def test_cli_and_tests_rows() -> None:
    cli = {"kind": "cli", "rc": [0, -9, 0, 0], "identical": True, "differing": [], "losses": [7.7, 6.8],
           "peft_loads": True}
    assert _failed(cli) == []
    assert _failed(dict(cli, identical=False, differing=["lm_head.weight"])) == ["resume bit-identical"]
    assert _failed(dict(cli, rc=[0, 0, 0, 0])) == ["killed"]
    assert _failed(dict(cli, peft_loads=False)) == ["LoRA loads in PEFT"]
    tests = {"kind": "tests", "rc": 0, "passed": 30, "failed": 0, "errors": 0, "summary": "30 passed"}
    assert _failed(tests) == []
    assert _failed(dict(tests, rc=1, failed=1)) == ["runs"]


def test_saved_runs_recheck_and_the_baseline_takes_only_passing_rows(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``--check DIR`` re-checks raw rows; ``--accept DIR`` records the rows whose checks (speed
    aside) pass -- the table of the matrix's own saved runs included."""
    run = tmp_path / "bench" / "results" / "acceptance" / "abc"
    run.mkdir(parents=True)
    (run / "w1.json").write_text(json.dumps(_engine_record(commit="abc")))
    (run / "w3.json").write_text(json.dumps(_engine_record(commit="abc", gpu_peak_reserved=23 * GiB)))
    monkeypatch.setattr(acceptance, "ROOT", tmp_path)
    monkeypatch.setattr(acceptance, "BASELINE", tmp_path / "baseline.json")
    assert acceptance.main(["--check", str(run)]) == 1
    acceptance.main(["--accept", str(run), "--note", "test"])
    rows = json.loads((tmp_path / "baseline.json").read_text())["rows"]
    assert list(rows) == ["w1"] and rows["w1"]["commit"] == "abc" and rows["w1"]["tokens_per_s"] == 20_000.0


def test_the_repositorys_baseline_names_raw_files_that_exist() -> None:
    data = json.loads(acceptance.BASELINE.read_text())
    assert data["rows"]
    for name, entry in data["rows"].items():
        assert name in acceptance.ROWS
        raw = json.loads((ROOT / entry["raw"]).read_text())
        assert raw["tokens_per_s"] == pytest.approx(entry["tokens_per_s"], abs=0.1)


def test_a_row_runs_in_a_child_and_is_checked(tmp_path: Path) -> None:
    """The tiny workload on the CPU through the real runner: a raw JSON per row and a table."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "acceptance.py"), "--rows", "tiny-cpu",
                           "--commit", "test", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    rec = json.loads((tmp_path / "tiny-cpu.json").read_text())
    assert rec["kind"] == "engine" and rec["commit"] == "test", proc.stdout + proc.stderr
    assert len(rec["losses"]) == 3 and rec["losses"][-1] < rec["losses"][0]
    assert rec["host_peak"] > 0 and rec["host_need"] > 0 and rec["plan"]
    table = (tmp_path / "table.txt").read_text()
    assert "tiny-cpu" in table and "rows pass" in table


def test_the_readme_table_is_the_accepted_rows() -> None:
    """README's headline table is generated from the baseline's raw files (``--readme``)."""
    text = acceptance.README.read_text()
    start = text.index(acceptance.README_BEGIN) + len(acceptance.README_BEGIN)
    assert text[start:text.index(acceptance.README_END)].strip() == acceptance.readme_table()
