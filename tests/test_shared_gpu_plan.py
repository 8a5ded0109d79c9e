"""Device lists that name one GPU several times (``cuda:0,cuda:0``: two pipeline stages on one GPU).

The GPU acceptance matrix (issue #31) found the planner treating such entries as separate GPUs:
W1's two-stage plan was estimated at 12.7 GiB per entry and ran 21.8 GiB on the one 24 GiB GPU,
and its time was predicted 24 % fast. Entries that share a GPU now split its memory budget, and
the time model floors the step at that GPU's share of all stages' compute and uploads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

import tinypipe
from benchkit.workloads import WORKLOADS
from tinypipe.planner.auto import budgets, entries_per_gpu, hardware_for
from tinypipe.planner.candidate import evaluate
from tinypipe.planner.hardware import HARDWARE
from tinypipe.planner.sizes import model_sizes
from tinypipe.schedule.plan import Plan
from tinypipe.units import GIB

ROOT = Path(__file__).resolve().parents[1]
#: the two W1 runs over cuda:0,cuda:0 on the H200 (24 GiB cap), with the plans the planner chose
#: before the floor (the time model was not fitted on them)
MEASURED = [ROOT / "bench/results/acceptance/e94db96/w1-2stage.json",
            ROOT / "bench/results/acceptance/7de4a21/w1-2stage.json"]


def test_entries_that_share_a_gpu_split_its_budget() -> None:
    assert entries_per_gpu(["cuda:0", "cuda:0"]) == 2
    assert entries_per_gpu(["cuda", "cuda:0", "cuda:1"]) == 2
    assert entries_per_gpu(["cuda:0", "cuda:1"]) == 1
    assert entries_per_gpu(["cpu", "cpu"]) == 1
    two = tinypipe.Config(devices=["cuda:0", "cuda:0"], gpu_memory_bytes=24 * GIB, cpu_memory_bytes=64 * GIB)
    one = tinypipe.Config(devices=["cuda:0", "cuda:1"], gpu_memory_bytes=24 * GIB, cpu_memory_bytes=64 * GIB)
    assert budgets(two)[0] == 12 * GIB and budgets(one)[0] == 24 * GIB
    shared = hardware_for(tinypipe.Config(devices=["cuda:0", "cuda:0"], hardware="h200-pcie5"))
    alone = hardware_for(tinypipe.Config(devices=["cuda:0", "cuda:1"], hardware="h200-pcie5"))
    assert shared.stages_per_gpu == 2 and alone.stages_per_gpu == 1 and alone == HARDWARE["h200-pcie5"]


@pytest.mark.parametrize("path", MEASURED, ids=["e94db96", "7de4a21"])
def test_a_shared_gpu_plan_is_predicted_within_15_percent(path: Path) -> None:
    """The measured two-stage runs' plans, timed on the shared H200: within 15 % of what ran (6 %
    at the time of writing), where the same plans timed as on two GPUs were 24 % / 29 % fast."""
    rec = json.loads(path.read_text())
    sizes = model_sizes(transformers.LlamaConfig(**WORKLOADS["W1"].config))
    plan = Plan.from_json(json.dumps(rec["plan_settings"]))
    shared = evaluate(sizes, HARDWARE["h200-pcie5"].shared_by(2), plan, seq=2048, global_batch=16)
    apart = evaluate(sizes, HARDWARE["h200-pcie5"], plan, seq=2048, global_batch=16)
    measured = rec["tokens_per_s"]
    assert abs(shared.time.tokens_per_s / measured - 1) <= 0.15, (shared.time.tokens_per_s, measured)
    assert apart.time.tokens_per_s / measured - 1 > 0.15  # what the planner said before: too fast
    # the floor is the GPU's share of every stage's compute
    assert shared.time.step_s >= shared.time.compute_s - 1e-9
