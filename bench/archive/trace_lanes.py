"""A traced step's tasks lane by lane, as text: name, start and duration in ms (device times
where the run was traced on CUDA). What the session 12 notes read the tail off: when each host
AdamW update ran against the backward and the uploads.

    python bench/archive/trace_lanes.py bench/results/s12_w1_turn_s12b.trace.json optimizer h2d
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def lane_rows(trace: Path, lane_filter: str) -> list[tuple[str, str, float, float]]:
    """(lane, task, start ms, duration ms) of the trace's spans on lanes whose name holds
    ``lane_filter``, in start order."""
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    spans = sorted((e for e in events if e["ph"] == "X"), key=lambda e: e["ts"])
    return [(lanes[e["tid"]], e["name"], e["ts"] / 1000, e["dur"] / 1000) for e in spans
            if lane_filter in lanes[e["tid"]]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("lanes", nargs="+", help="lane name substrings (compute, h2d, d2h, optimizer, deferred)")
    a = ap.parse_args()
    for want in a.lanes:
        rows = lane_rows(a.trace, want)
        print(f"== {want}: {len(rows)} tasks")
        print(" | ".join(f"{task} {start:.1f} +{dur:.1f}" for _, task, start, dur in rows))


if __name__ == "__main__":
    main()
