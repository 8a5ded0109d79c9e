"""Non-finite decisions are the same on every rank: a NaN in one rank's local gradient reaches
every rank through the reduction (sharded: through the all-reduced squared norm of the shards), so
every rank skips the step and the state stays as one process that skipped it."""

from __future__ import annotations

from pathlib import Path

import pytest

from _dist_check import assert_exact
from _dist_run import run


@pytest.mark.parametrize("sharding", ["shard", "replicate"])
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(sharding: str, tmp_path: Path) -> None:
    """A NaN in one rank's local gradient of one layer (step 2 of 3): summed across the replicas it
    reaches every rank, so every rank skips that step (``nonfinite="skip"``: state untouched) --
    and the run equals one process trained on steps 1 and 3 only."""
    spec = dict(family="llama", batch=4, steps=3, poison=(1, 1, 2),
                cfg=dict(pack_size=1, micro_batch_size=2, nonfinite="skip", max_grad_norm=1.0,
                         optimizer_sharding=sharding))
    results = run(spec, 2, tmp_path)
    for r in results:
        assert r["skipped"] == [False, True, False]
    kept = [dict(r, losses=[r["losses"][0], r["losses"][2]], norms=[r["norms"][0], r["norms"][2]],
                 clipped=[r["clipped"][0], r["clipped"][2]]) for r in results]
    assert_exact(dict(spec, skip_steps=[1]), kept)
