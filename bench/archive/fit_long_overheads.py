"""Refit the time model's two long-sequence constants (``planner/work.py`` ``CHUNK_CALL_S``,
``TILE_MERGE_S``) from a profile of ``long_step_profile.py --runs ...`` (its JSON), the way they
were first fitted, so a new profile (after a change to the chunk loop or the tiles) gives new
constants in one command:

    python3 bench/archive/fit_long_overheads.py bench/results/long_context/diagnose_SHA/long_step_profile.json

* ``CHUNK_CALL_S``: settings that differ only in MLP chunking (same length and tile): the measured
  step difference less what the planner priced of it, per chunked-module call and pass, added to
  the constant the profile was priced with.
* ``TILE_MERGE_S``: settings that differ only in the attention tile (tiles vs whole segments):
  the same, per token and merge.

The calls and merges are counted by the planner's own ``long_sequence_overheads`` for the plan
each setting ran (the acceptance row's shape: pack 1, micro-batch 1, host stash), so the fit and
the model count the same things. A profile without the constants it was priced with (written
before ``long_step_profile.py`` recorded them) needs ``--priced-with CHUNK,TILE``: the f420d48
profile, which the constants were first fitted on, was priced before either existed (0,0).
Assumes the step is compute-bound (the overheads add to it one for one), as at 64K.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CONSTANTS = ("CHUNK_CALL_S", "TILE_MERGE_S")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="long_step_profile.json")
    ap.add_argument("--priced-with", default=None, metavar="CHUNK,TILE",
                    help="the constants the profile's predictions were priced with, where it does not record them")
    ap.add_argument("--hardware", default="h200-pcie5", help="the preset the profile was priced on")
    ap.add_argument("--json", default=None, help="write the fit here")
    return ap.parse_args(argv)


def resolved(rec: dict[str, Any]) -> tuple[int, int]:
    """(MLP chunk tokens, attention tile tokens) the setting ran: recorded, or for an older profile
    what its ``auto`` meant then (the chunk rule; the default 8K tile of a hand-set plan)."""
    from tinypipe.models.chunked_mlp import mlp_chunk_tokens_for
    from tinypipe.models.tiled_attention import ATTENTION_TILE_OPTIONS

    chunk = rec.get("mlp_chunk_resolved")
    if chunk is None:
        chunk = mlp_chunk_tokens_for(rec["mlp_chunk_tokens"], 14336, 2, rec["seq"])
    tile = rec.get("attention_tile_resolved")
    if tile is None:
        tile = min(ATTENTION_TILE_OPTIONS) if rec["attention_tile_tokens"] is None else rec["attention_tile_tokens"]
    return int(chunk), int(tile)


def counts(rec: dict[str, Any], hardware: str) -> tuple[float, float]:
    """(chunked-module calls and passes, token merges at the reference rate) the planner prices for
    the setting: its ``long_sequence_overheads`` with one constant 1 and the other 0, in turn."""
    from tinypipe.lora.settings import LoraSettings
    from tinypipe.planner import work
    from tinypipe.planner.hardware import load_hardware
    from tinypipe.planner.presets import load_model_config
    from tinypipe.planner.sizes import lora_sizes, model_sizes
    from tinypipe.schedule.plan import make_plan

    chunk, tile = resolved(rec)
    cfg = load_model_config("llama-3.1-8b")
    cfg.num_hidden_layers = rec["layers"]
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, rec["seq"])
    scheme = rec.get("scheme", "nf4")
    sizes = (model_sizes(cfg) if scheme == "none" else
             lora_sizes(cfg, LoraSettings(rank=16, alpha=32.0, quantize=scheme, compute_dtype="bf16")))
    sizes = dataclasses.replace(sizes, attention_tile=tile)
    plan = make_plan(sizes.num_blocks, pack_size=1, micro_batch_size=1, backward_micro_batch_size=1, num_devices=1,
                     prefetch_window=1, stash="host", tied=sizes.tied)
    if plan.describe() != rec["plan"]:
        raise SystemExit(f"fit_long_overheads: {rec['label']} ran '{rec['plan']}', not the plan counted here "
                         f"('{plan.describe()}')")
    hw = load_hardware(hardware)

    def priced(chunk_call_s: float, tile_merge_s: float) -> float:
        per_pack = work.long_sequence_overheads(sizes, plan, hw, batch=1, seq=rec["seq"], mlp_chunk=chunk,
                                                chunk_call_s=chunk_call_s, tile_merge_s=tile_merge_s)
        return sum(f + b for f, b in per_pack)

    return priced(1.0, 0.0), priced(0.0, 1.0)


def priced_with(rec: dict[str, Any], given: tuple[float, float] | None) -> tuple[float, float]:
    if given is not None:
        return given
    if "priced_with" not in rec:
        raise SystemExit(f"fit_long_overheads: {rec['label']} does not record the constants it was priced with; "
                         "say them: --priced-with CHUNK,TILE")
    return rec["priced_with"]["CHUNK_CALL_S"], rec["priced_with"]["TILE_MERGE_S"]


def fit(records: list[dict[str, Any]], hardware: str, given: tuple[float, float] | None) -> dict[str, Any]:
    """Each constant from every pair of settings that differ in its feature alone (the mean where
    several pairs do); the pairs with their residuals."""
    keyed = [(rec, resolved(rec), counts(rec, hardware), priced_with(rec, given)) for rec in records]
    pairs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONSTANTS}
    for i, (a, (ca, ta), (na, ma), pa) in enumerate(keyed):
        for b, (cb, tb), (nb, mb), pb in keyed[i + 1:]:
            if a["seq"] != b["seq"] or a["layers"] != b["layers"]:
                continue
            for name, differs, count, k in (("CHUNK_CALL_S", ca != cb and ta == tb, na - nb, 0),
                                            ("TILE_MERGE_S", ta != tb and ca == cb, ma - mb, 1)):
                if not differs or count == 0 or pa[k] != pb[k]:
                    continue
                residual = (a["step_s"] - b["step_s"]) - (a["predicted"]["step_s"] - b["predicted"]["step_s"])
                pairs[name].append({"settings": [a["label"], b["label"]], "count": count, "residual_s": residual,
                                    "value": pa[k] + residual / count})
    return {name: {"value": (sum(p["value"] for p in ps) / len(ps)) if ps else None, "pairs": ps}
            for name, ps in pairs.items()}


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    from tinypipe.planner import work

    records = json.loads(Path(a.profile).read_text())
    given = tuple(float(x) for x in a.priced_with.split(",")) if a.priced_with else None
    result = fit(records, a.hardware, given)  # type: ignore[arg-type]
    for name, r in result.items():
        for p in r["pairs"]:
            print(f"{name}: {p['settings'][0]} vs {p['settings'][1]}: residual {p['residual_s']:+.4f} s over "
                  f"{p['count']:,.0f} -> {p['value']:.4g}")
        now = getattr(work, name)
        print(f"{name} = {r['value']:.4g}   (planner/work.py now: {now:.4g})" if r["value"] is not None
              else f"{name}: no pair of settings differs in it alone")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
