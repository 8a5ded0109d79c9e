"""The exactness tests' tolerances catch a wrong data-parallel reduction: the same run with each
replica normalising its loss by its own tokens only (no global token count), or with every
gradient summed twice, misses the single-process reference by orders of magnitude more than
tests/test_distributed_exact.py allows (1e-5 per tensor, 1e-4 on the update)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _dist_check import errors
from _dist_run import run

SPEC = dict(family="llama", batch=4, steps=2, cfg=dict(pack_size=2, micro_batch_size=2,
                                                       optimizer_sharding="replicate"))


@pytest.mark.parametrize("sabotage", ["local_tokens", "double_reduce"])
def test_a_wrong_reduction_fails_the_tolerances(sabotage: str, tmp_path: Path) -> None:
    e = errors(SPEC, run(dict(SPEC, sabotage=sabotage), 2, tmp_path))
    # gradients off by a factor of ~2: the loss of step 2 and the gradient norms are far off
    assert e["norm"] > 100 * 1e-5, e
    assert e["update"] > 100 * 1e-4 or e["weights"] > 100 * 1e-5, e
