"""The GPU acceptance matrix's machinery (bench/acceptance.py) on the CPU: its checks fail what they
must, and a row runs end to end in a child process and is checked from its raw JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import acceptance  # noqa: E402
import acceptance_runner  # noqa: E402

GiB = 1024**3
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"


def _engine_record(**over: object) -> dict:
    rec = {"kind": "engine", "row": {"devices": ["cuda:0"]}, "plan": "pack 1", "losses": [12.0, 11.5, 11.0],
           "gpu_peak_reserved": 18 * GiB, "gpu_cap": 24 * GiB, "gpu_need": 20 * GiB, "host_peak": 40 * GiB,
           "host_need": 40 * GiB, "tokens_per_s": 20_000.0, "predicted_tokens_per_s": 21_000.0,
           "gpu_name": H200}
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
    named = acceptance.check("gpu-tests", dict(tests, rc=1, failed=1, failures=["FAILED tests/t.py::x[a]"]), {})
    assert named == [("runs", False, "30 passed; tests/t.py::x[a]")]


def test_a_failed_test_row_keeps_pytest_failures_section() -> None:
    """The gpu-tests row keeps each failure's traceback (the 6f6b4b7 row kept only the log's tail:
    torch's DEBUG lines, no assertion), and nothing when every test passed."""
    from acceptance_rows import failure_text

    out = "\n".join([
        "..F.", "=================================== FAILURES ===================================",
        "_____ test_x[a] _____", "tests/t.py:7: in test_x", "    assert 1 == 2", "E   assert 1 == 2",
        "=============================== warnings summary ===============================", "w",
        "=========================== short test summary info ============================",
        "FAILED tests/t.py::test_x[a] - assert 1 == 2", "1 failed, 3 passed in 1.00s"])
    text = failure_text(out)
    assert text.splitlines()[1] == "_____ test_x[a] _____" and "E   assert 1 == 2" in text
    assert "warnings summary" not in text and "short test summary" not in text
    assert failure_text("....\n4 passed in 1.00s") == ""
    assert len(failure_text(out, limit=50)) == 50


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
    gpus = json.loads((tmp_path / "baseline.json").read_text())["gpus"]
    assert list(gpus) == [H200]
    rows = gpus[H200]["rows"]
    assert list(rows) == ["w1"] and rows["w1"]["commit"] == "abc" and rows["w1"]["tokens_per_s"] == 20_000.0
    assert acceptance.load_baseline(H200) == rows and acceptance.load_baseline(H100) == {}


def _speed(rec: dict, baseline: dict) -> tuple[bool, str]:
    [(ok, detail)] = [(ok, d) for c, ok, d in acceptance.check("w1", rec, baseline) if c.startswith("speed")]
    return ok, detail


def test_the_speed_baseline_is_the_records_own_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An H100 row is not held to the H200's number: with no H100 baseline it passes and says so;
    a slow row on the H200 itself fails -- one record at a time and through ``check_dir`` (``--check``)."""
    monkeypatch.setattr(acceptance, "ROOT", tmp_path)
    monkeypatch.setattr(acceptance, "BASELINE", tmp_path / "baseline.json")
    base = {"tokens_per_s": 40_000.0, "commit": "old", "raw": "x/w1.json", "note": ""}
    acceptance.save_baselines({H200: {"w1": base}})
    slow_h100 = _engine_record(gpu_name=H100)  # 20,000 tok/s: half the H200's
    assert acceptance.load_baseline(H100) == {}
    assert _speed(slow_h100, acceptance.load_baseline(H100)) == (True,
                                                                 f"20,000 tok/s (no baseline yet on {H100})")
    slow_h200 = _engine_record()
    ok, detail = _speed(slow_h200, acceptance.load_baseline(H200))
    assert not ok and detail == "20,000 vs 40,000 (old, H200)"

    for gpu in (H100, H200):
        run = tmp_path / gpu.replace(" ", "_")
        run.mkdir()
        (run / "w1.json").write_text(json.dumps(_engine_record(commit="new", gpu_name=gpu)))
        _, checks, _ = acceptance.check_dir(run)
        failed = [c for c, ok, _ in checks["w1"] if not ok]
        assert failed == ([] if gpu == H100 else ["speed >= 0.9 x baseline"]), gpu


def test_accept_writes_under_the_records_gpu_and_keeps_the_others(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acceptance, "ROOT", tmp_path)
    monkeypatch.setattr(acceptance, "BASELINE", tmp_path / "baseline.json")
    h200_rows = {"w1": {"tokens_per_s": 40_000.0, "commit": "old", "raw": "x/w1.json", "note": "h200"},
                 "w3": {"tokens_per_s": 10_000.0, "commit": "old", "raw": "x/w3.json", "note": "h200"}}
    acceptance.save_baselines({H200: h200_rows})
    run = tmp_path / "bench" / "results" / "acceptance" / "def"
    run.mkdir(parents=True)
    (run / "w1.json").write_text(json.dumps(_engine_record(commit="def", gpu_name=H100)))
    assert acceptance.accept(run, "first H100 run") == 0
    gpus = json.loads((tmp_path / "baseline.json").read_text())["gpus"]
    assert gpus[H200]["rows"] == h200_rows  # untouched
    assert gpus[H100]["rows"] == {"w1": {"tokens_per_s": 20_000.0, "commit": "def", "note": "first H100 run",
                                         "raw": "bench/results/acceptance/def/w1.json"}}


def test_an_old_format_baseline_reads_each_row_under_its_raw_files_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acceptance, "ROOT", tmp_path)
    monkeypatch.setattr(acceptance, "BASELINE", tmp_path / "baseline.json")
    for name, gpu in (("w1", H200), ("w3", H100)):
        (tmp_path / f"{name}.json").write_text(json.dumps(_engine_record(gpu_name=gpu)))
    rows = {n: {"tokens_per_s": 1.0, "commit": "c", "raw": f"{n}.json", "note": ""} for n in ("w1", "w3")}
    (tmp_path / "baseline.json").write_text(json.dumps({"rows": rows}))
    assert acceptance.load_baselines() == {H200: {"w1": rows["w1"]}, H100: {"w3": rows["w3"]}}


def test_short_gpu_names() -> None:
    assert acceptance.short_gpu(H200) == "H200"
    assert acceptance.short_gpu(H100) == "H100"
    assert acceptance.short_gpu("NVIDIA GeForce RTX 4090") == "GeForce RTX 4090"
    assert acceptance.short_gpu("cpu") == "cpu"


def test_the_repositorys_baseline_names_raw_files_that_exist() -> None:
    data = json.loads(acceptance.BASELINE.read_text())
    assert data["gpus"] and data["gpus"].get(H200, {}).get("rows")
    for gpu, entry in data["gpus"].items():
        for name, row in entry["rows"].items():
            assert name in acceptance.ROWS
            raw = json.loads((ROOT / row["raw"]).read_text())
            assert raw["gpu_name"] == gpu, row["raw"]
            assert raw["tokens_per_s"] == pytest.approx(row["tokens_per_s"], abs=0.1)


def test_a_row_runs_in_a_child_and_is_checked(tmp_path: Path) -> None:
    """The tiny workload on the CPU through the real runner: a raw JSON per row and a table."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "acceptance.py"), "--rows", "tiny-cpu",
                           "--commit", "test", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    rec = json.loads((tmp_path / "tiny-cpu.json").read_text())
    assert rec["kind"] == "engine" and rec["commit"] == "test", proc.stdout + proc.stderr
    assert len(rec["losses"]) == 3 and rec["losses"][-1] < rec["losses"][0]
    assert rec["host_peak"] > 0 and rec["host_need"] > 0 and rec["plan"]
    # the planner's activation peak taken apart, for a row whose GPU peak exceeds the estimate
    estimate, = rec["activation_estimate"]
    assert estimate["phase"] and all(v > 0 for v in estimate["parts"].values())
    table = (tmp_path / "table.txt").read_text()
    assert "tiny-cpu" in table and "rows pass" in table


def test_the_readme_table_is_the_accepted_rows() -> None:
    """README's headline table is generated from the baseline's raw files (``--readme``)."""
    text = acceptance.README.read_text()
    start = text.index(acceptance.README_BEGIN) + len(acceptance.README_BEGIN)
    assert text[start:text.index(acceptance.README_END)].strip() == acceptance.readme_table()


def test_the_full_tier_passes_only_when_every_part_ran_and_passed() -> None:
    """A directory holding one passing part is not a passed matrix: the verdict names the rows that
    did not run (and their parts) and the ones that failed."""
    names = [n for part in acceptance.FULL_PARTS.values() for n in part]
    ok = [("runs", True, "")]
    assert acceptance.full_tier_verdict({n: ok for n in names}, "abc").startswith("full tier: passed at abc")
    part3 = {n: ok for n in acceptance.FULL_PARTS[3]}
    verdict = acceptance.full_tier_verdict(part3, "abc")
    assert verdict.startswith("full tier: NOT passed at abc")
    assert "not run: " in verdict and "part 1, 2, 4" in verdict and "failed" not in verdict
    one_bad = {n: ok for n in names} | {"w1": [("runs", True, ""), ("speed", False, "slow")]}
    verdict = acceptance.full_tier_verdict(one_bad, "abc")
    assert "failed: w1" in verdict and "not run" not in verdict


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_rows_of_another_commit_count_only_where_the_code_under_test_is_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The full tier may span device calls at several commits: a row measured at an older commit
    counts where only files outside ``CODE_UNDER_TEST`` changed since (raw results, notes); where
    ``tinypipe/`` changed it does not, and the verdict says it did not run."""
    repo = tmp_path / "repo"
    (repo / "tinypipe").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "tinypipe" / "engine.py").write_text("A = 1\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "code")
    old = _git(repo, "rev-parse", "HEAD")
    (repo / "RESULTS.md").write_text("rows\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "results only")
    same = _git(repo, "rev-parse", "HEAD")
    (repo / "tinypipe" / "engine.py").write_text("A = 2\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "code changed")
    changed = _git(repo, "rev-parse", "HEAD")
    monkeypatch.setattr(acceptance, "ROOT", repo)
    monkeypatch.setattr(acceptance, "BASELINE", tmp_path / "baseline.json")
    assert acceptance.code_differs(old, same) == []
    assert acceptance.code_differs(old, changed) == ["tinypipe/engine.py"]
    assert acceptance.code_differs(old, "0" * 40) == ["?"]

    names = [n for part in acceptance.FULL_PARTS.values() for n in part]
    first, rest = names[:3], names[3:]

    def saved(commit: str, rows: list[str]) -> Path:
        d = tmp_path / commit[:7]
        d.mkdir()
        for n in rows:
            (d / f"{n}.json").write_text(json.dumps(_engine_record(commit=commit)))
        return d

    newest, older, stale = saved(same, first), saved(old, rest), saved(changed, rest)
    results, checks, commit, notes = acceptance.check_dirs([newest, older])
    assert commit == same and sorted(results) == sorted(names)
    assert acceptance.full_tier_verdict(checks, commit).startswith(f"full tier: passed at {same}")
    assert "counted (measured at" in notes[0]
    results, checks, commit, notes = acceptance.check_dirs([newest, stale])
    assert sorted(results) == sorted(first) and "not counted" in notes[0] and "tinypipe/engine.py" in notes[0]
    assert "NOT passed" in acceptance.full_tier_verdict(checks, commit)
    # a row the first directory holds is not replaced by an older one
    (older / f"{first[0]}.json").write_text(json.dumps(_engine_record(commit=old, losses=[1.0, 2.0])))
    _, checks, _, _ = acceptance.check_dirs([newest, older])
    assert all(ok for _, ok, _ in checks[first[0]])


def test_the_cli_row_runs_beside_the_gpu_tests_and_only_there() -> None:
    """The full tier's part with the GPU tests runs the CLI row in the same group (at the same time);
    the quick tier, which has no GPU tests, runs it on its own, after the engine rows."""
    part = list(next(p for p in acceptance.FULL_PARTS.values() if "gpu-tests" in p))
    assert ["gpu-tests", "cli"] in acceptance.groups(part, acceptance.BESIDE)
    assert acceptance.groups(list(acceptance.QUICK), acceptance.BESIDE)[-1] == ["cli"]
    assert acceptance.groups(["cli", "w1", "gpu-tests"], acceptance.BESIDE) == [["w1"], ["gpu-tests", "cli"]]
    names = [n for p in acceptance.FULL_PARTS.values() for n in p]
    assert sorted(names) == sorted(set(names)) and set(acceptance.QUICK) <= set(names)
    assert sorted(acceptance.PART_ORDER) == sorted(acceptance.FULL_PARTS)


def test_a_group_runs_its_rows_at_the_same_time(tmp_path: Path) -> None:
    """Two real CPU rows as one group: each writes its own record and wall time, and the group takes
    less than the two walls one after the other (they overlapped)."""
    args = acceptance.parse(["--commit", "test", "--out", str(tmp_path)])
    t0 = time.perf_counter()
    recs = acceptance.run_rows(["tiny-cpu", "tiny-cpu-clip"], args, tmp_path, None)
    elapsed = time.perf_counter() - t0
    for name, other in (("tiny-cpu", "tiny-cpu-clip"), ("tiny-cpu-clip", "tiny-cpu")):
        rec = json.loads((tmp_path / f"{name}.json").read_text())
        assert not rec.get("error"), rec.get("error")
        assert rec["beside"] == [other] and rec["wall_s"] == recs[name]["wall_s"]
        assert rec["losses"][-1] < rec["losses"][0]
    assert recs["tiny-cpu-clip"]["row"]["max_grad_norm"] == 0.5 and recs["tiny-cpu"]["row"]["max_grad_norm"] is None
    assert elapsed < 0.8 * (recs["tiny-cpu"]["wall_s"] + recs["tiny-cpu-clip"]["wall_s"])


def test_remaining_joins_the_rows_of_this_code_and_names_the_calls_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--remaining``: rows measured at older commits count where the code under test is HEAD's
    (not where it differs); a failed row is to be run again; whole parts left are named as parts,
    the rest as ``--rows``; uncommitted code under test is warned about."""
    repo = tmp_path / "repo"
    (repo / "tinypipe").mkdir(parents=True)
    _git(repo, "init", "-q")
    commits = []
    for i, (path, text) in enumerate([("tinypipe/engine.py", "A = 1\n"), ("tinypipe/engine.py", "A = 2\n"),
                                      ("NOTES.md", "rows\n")]):
        (repo / path).write_text(text)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", f"c{i}", "--date", f"2026-12-0{i + 1}T00:00:00")
        commits.append(_git(repo, "rev-parse", "--short=12", "HEAD"))
    old, code, head = commits
    monkeypatch.setattr(acceptance, "ROOT", repo)
    monkeypatch.setattr(acceptance, "BASELINE", tmp_path / "baseline.json")
    results = tmp_path / "results"
    parts = acceptance.FULL_PARTS

    def saved(commit: str, rows: list[str], **over: object) -> None:
        d = results / commit
        d.mkdir(parents=True, exist_ok=True)
        for n in rows:
            (d / f"{n}.json").write_text(json.dumps(_engine_record(commit=commit, **over)))

    saved(old, [n for p in parts.values() for n in p])  # every row, but at other code: not counted
    saved(code, list(parts[2]) + list(parts[1][1:]))  # the same code as HEAD: counted
    saved(head, [parts[1][0]], losses=[1.0, 2.0])  # HEAD itself: a row that failed (loss rose)
    assert acceptance.remaining("HEAD", results) == 1
    out = capsys.readouterr().out
    assert old not in out  # not joined at all: other code
    assert f"full tier: NOT passed at {head}" in out and f"failed: {parts[1][0]}" in out
    calls = [line.strip() for line in out.splitlines() if "acceptance_device.sh" in line]
    assert [c.split("   #")[0] for c in calls] == [
        f"DEADLINE=540 bash bench/acceptance_device.sh {head} --tier full --part {k}"
        for k in acceptance.PART_ORDER if k in (3, 4)
    ] + [f"DEADLINE=540 bash bench/acceptance_device.sh {head} --rows {parts[1][0]}"]
    assert "warning" not in out
    (repo / "tinypipe" / "engine.py").write_text("A = 3\n")
    acceptance.remaining("HEAD", results)
    assert "warning: uncommitted changes to the code under test (tinypipe/engine.py)" in capsys.readouterr().out
    saved(head, [n for p in parts.values() for n in p])  # everything passing at HEAD: done
    assert acceptance.remaining(head, results) == 0
    assert f"full tier: passed at {head}" in capsys.readouterr().out


def test_a_row_past_its_limit_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    """A child that started a grandchild (as the tests row starts pytest's workers): killing the
    row's process group ends both, so nothing of it runs on beside the next row."""
    import os

    pid_file = tmp_path / "grandchild.pid"
    with (tmp_path / "log").open("w+") as log:
        proc = acceptance_runner.launch(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], log)
        deadline = time.monotonic() + 10
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        assert acceptance_runner.kill_group(proc) == -9
    deadline = time.monotonic() + 10
    while True:  # the grandchild is gone (a zombie of its reaped parent counts as gone)
        try:
            with open(f"/proc/{grandchild}/stat") as fh:
                state = fh.read().split(")")[-1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        assert time.monotonic() < deadline, f"grandchild {grandchild} still {state}"
        time.sleep(0.05)
    assert os.getpgid(os.getpid()) != proc.pid  # the row's group was its own, not the runner's
