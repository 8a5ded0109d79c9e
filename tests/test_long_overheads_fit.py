"""The refit of the time model's long-sequence constants (bench/archive/fit_long_overheads.py): on
the profile they were first fitted on it gives them back; it corrects for the constants a profile
was priced with; it refuses a profile that does not say them."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "archive"))

import fit_long_overheads as fit  # noqa: E402

from tinypipe.planner import work  # noqa: E402

PROFILE = ROOT / "bench" / "results" / "long_context" / "diagnose_f420d4828575" / "long_step_profile.json"


def _records() -> list[dict]:
    return json.loads(PROFILE.read_text())


def test_the_first_profile_gives_the_constants_back() -> None:
    """f420d48's profile (priced before either constant existed): 512 chunked-module calls and
    passes (4 blocks x 8 chunks x 4 modules x 4 passes) and 917,504 merges (4 blocks x 65,536
    tokens x 3.5) give planner/work.py's values to their rounding."""
    result = fit.fit(_records(), "h200-pcie5", (0.0, 0.0))
    chunk, tile = result["CHUNK_CALL_S"], result["TILE_MERGE_S"]
    assert [p["count"] for p in chunk["pairs"]] == [512]
    assert [p["count"] for p in tile["pairs"]] == [4 * 65536 * 3.5]
    assert chunk["value"] == pytest.approx(work.CHUNK_CALL_S, rel=0.01)
    assert tile["value"] == pytest.approx(work.TILE_MERGE_S, rel=0.01)


def test_a_profile_priced_with_the_constants_refits_to_the_same_values() -> None:
    """The same measurements priced by a planner that already charged the constants (each setting's
    prediction longer by constant x its count, and the profile saying so): the same fit -- the
    correction adds back what the prediction already held."""
    records = copy.deepcopy(_records())
    charged = (0.5e-3, 300e-9)
    for rec in records:
        calls, merges = fit.counts(rec, "h200-pcie5")
        rec["predicted"]["step_s"] += charged[0] * calls + charged[1] * merges
        rec["priced_with"] = {"CHUNK_CALL_S": charged[0], "TILE_MERGE_S": charged[1]}
    again = fit.fit(records, "h200-pcie5", None)
    first = fit.fit(_records(), "h200-pcie5", (0.0, 0.0))
    for name in fit.CONSTANTS:
        assert again[name]["value"] == pytest.approx(first[name]["value"], rel=1e-9)


def test_a_profile_that_does_not_say_its_pricing_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="--priced-with CHUNK,TILE"):
        fit.main([str(PROFILE)])
    assert fit.main([str(PROFILE), "--priced-with", "0,0"]) == 0
    out = capsys.readouterr().out
    assert "CHUNK_CALL_S = 0.000603" in out and "TILE_MERGE_S = 2.18" in out
