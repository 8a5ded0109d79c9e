"""bench/dp_bench.py on the CPU (gloo, the tiny workload) -- what the lead runs on the GPU with W1/W3:
two replicas run the plan the driver planned and checked (``--auto``), the same losses on both
ranks; a configuration whose predicted host need exceeds what the node has is refused before any
process starts; and the prediction itself (bench/dp_predict.py): the replicas' unmodelled host
buffers, and an automatic plan that always fits the budget it was planned for."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchkit.workloads import WORKLOADS
from tinypipe.errors import PlanDoesNotFitError

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
GiB = 1024**3


def _load_predict():  # from its file, under its own name (bench/ is on sys.path only for benchkit)
    spec = importlib.util.spec_from_file_location("dp_predict", BENCH / "dp_predict.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["dp_predict"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


dp_predict = _load_predict()


def _bench(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    cmd = [sys.executable, str(BENCH / "dp_bench.py"), "--mode", "cpu", "--workloads", "tiny",
           "--out", str(out / "runs"), "--json", str(out / "rows.json"), *args]
    done = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=300)
    rows = json.loads((out / "rows.json").read_text()) if (out / "rows.json").exists() else []
    return done, rows


def test_two_replicas_run_the_checked_plan(tmp_path: Path) -> None:
    done, rows = _bench(tmp_path, "--configs", "replicas", "--auto", "--sharding", "shard",
                        "--warmup", "1", "--steps", "1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = rows
    pred, check = row["prediction"], row["preflight"]
    assert pred["auto"] and pred["procs"] == 2 and "2 replicas (optimizer state sharded)" in pred["plan"]
    assert check["ok"] and check["need"] == pred["need_all_processes"] == 2 * pred["per_process"]
    assert check["need"] + check["reserve"] <= check["available"] == row["node_memory"]["available"]
    ranks = sorted(row["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["plan_json"] == pred["plan_json"] for r in ranks)  # the plan the pre-flight counted
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == 2
    assert sorted(p["rank"] for p in row["progress"]) == [0, 1]
    assert "pre-flight: predicted host need" in done.stdout and "predicted host per process" in done.stdout


def test_refused_before_any_process_starts(tmp_path: Path) -> None:
    # a node of 1 GiB: the hand-set plan is evaluated and refused; the planner finds nothing at all
    for auto in ((), ("--auto",)):
        done, rows = _bench(tmp_path, "--configs", "one,replicas", "--node-memory-gib", "1", *auto)
        assert done.returncode == 1
        assert [r["config"] for r in rows] == ["one", "replicas"]
        for r in rows:
            assert r["rc"] is None and not r["preflight"]["ok"] and r["ranks"] == [] and r["log"] is None
            assert "refused" in r["refused"] and r["refused"] in done.stdout
            assert (r["prediction"] is None) == bool(auto)
        assert not list((tmp_path / "runs").glob("*.log"))  # no configuration was started


def test_unmodelled_buffers_of_replicas() -> None:
    import transformers

    from tinypipe.planner.sizes import model_sizes

    sizes = model_sizes(transformers.LlamaConfig(**WORKLOADS["W1"].config))
    largest = max(sizes.layer_train_numels)  # W1's tied embedding, 394 M
    assert largest == 128256 * 3072
    piece = largest // 2
    shared = dp_predict.unmodelled(sizes, 2, "shard", gloo_cuda=True)
    assert shared["shard_gather_buffers"] == 4 * piece * 3
    assert shared["gloo_allgather_output"] == 4 * piece * 2
    # pinned staging, one power-of-two block per size class: the embedding (1.58 GB: 2 GiB), a block
    # (0.40 GB: 512 MiB), the tied head's final norm (12 KiB: 16 KiB)
    assert shared["gloo_pinned_staging"] == 2 * GiB + 512 * 2**20 + 16 * 2**10
    assert dp_predict.unmodelled(sizes, 2, "replicate", gloo_cuda=False) == {}  # NCCL, replicated
    assert dp_predict.unmodelled(sizes, 1, "shard", gloo_cuda=True) == {}  # one process: none


def test_automatic_plan_fits_the_budget_it_was_planned_for() -> None:
    s = dp_predict.Setting("share", "shard", True, 1, 2, "bf16", 24 * GiB, "h200-pcie5")
    w3 = WORKLOADS["W3"]
    for node in (128 * GiB, 119 * GiB):
        p = dp_predict.predict(w3, s, 2, ["cuda:0"], node)
        assert p.need <= node and p.need == 2 * p.host_per_process
        assert p.plan.replicas == 2 and p.plan.optimizer_sharding == "shard"
    with pytest.raises(PlanDoesNotFitError, match="per process after"):
        dp_predict.predict(w3, s, 2, ["cuda:0"], 110 * GiB)  # 2 x (50.2 GiB state + ...) does not fit
