"""What is alive on a CUDA device at the peak of one step: the allocator's own event history
(``torch.cuda.memory._record_memory_history``) replayed to the moment allocated bytes were highest,
and the blocks alive then, grouped by the code that allocated them.

Why: an acceptance row whose GPU peak exceeds the planner's estimate (6f6b4b7 on an H100:
QLoRA 8B at 2 x 64K tokens, 17.87 GiB measured vs 9.61 estimated) says *that* the estimate is short,
not *what* it missed; the device machine is lent for minutes, so the row must bring the answer back
in its own raw file. The replay is a pure function of the trace (tested on the CPU with traces in
the allocator's format); only :func:`record_step` needs CUDA.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

#: Path fragments of the frames worth naming: the innermost frame in our code and the innermost in
#: a library that allocated (the model code, bitsandbytes, peft, torch's own Python).
OWN = ("/tinypipe/",)
LIBRARIES = ("/transformers/", "/bitsandbytes/", "/peft/", "/torch/")


def _where(frames: Sequence[dict[str, Any]], parts: Sequence[str]) -> str:
    """``file:line (function)`` of the innermost frame whose file contains one of ``parts``."""
    for f in frames:  # the allocator lists frames innermost first
        name = str(f.get("filename", ""))
        if any(p in name for p in parts):
            tail = name.rsplit("/", 2)
            return f"{'/'.join(tail[-2:])}:{f.get('line')} ({f.get('name')})"
    return "?"


def peak_breakdown(trace: Sequence[dict[str, Any]], baseline: int = 0, top: int = 25) -> dict[str, Any]:
    """Replay ``trace`` (one device's ``device_traces`` entries, oldest first): the highest
    allocated bytes (``baseline``: what was allocated before the trace began) and the blocks alive
    at that moment, grouped by (our innermost frame, the library's innermost frame, the innermost
    frame: Inductor's generated code, say), largest first. A block counts from its ``alloc`` to
    its ``free_requested`` (the program let go of it; ``free_completed``, when the allocator may
    reuse it, follows); a free of a block allocated before the trace began lowers the count below
    the baseline, as it did on the device."""
    current = peak = baseline
    peak_index = -1
    for i, e in enumerate(trace):  # first pass: when the count was highest
        action = e.get("action")
        if action == "alloc":
            current += int(e["size"])
            if current > peak:
                peak, peak_index = current, i
        elif action == "free_requested":  # (its free_completed follows: the same block, not again)
            current -= int(e["size"])
    at_peak: dict[int, dict[str, Any]] = {}
    for e in trace[: peak_index + 1]:  # second pass: the blocks alive then
        if e.get("action") == "alloc":
            at_peak[e["addr"]] = e
        elif e.get("action") == "free_requested":
            at_peak.pop(e["addr"], None)
    groups: dict[tuple[str, str, str], list[int]] = {}
    for e in at_peak.values():
        frames = e.get("frames") or []
        key = (_where(frames, OWN), _where(frames, LIBRARIES), _where(frames, ("",)))
        g = groups.setdefault(key, [0, 0])
        g[0] += int(e["size"])
        g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {
        "peak_allocated": peak, "baseline": baseline, "events": len(trace), "peak_event": peak_index,
        "alive_at_peak": sum(int(e["size"]) for e in at_peak.values()),
        "groups": [{"ours": k[0], "library": k[1], "innermost": k[2], "bytes": v[0], "blocks": v[1]}
                   for k, v in rows[:top]],
        "other_bytes": sum(v[0] for _, v in rows[top:]),
    }


def record_step(step: Callable[[], Any], device: str, top: int = 25,
                max_entries: int = 2_000_000) -> dict[str, Any]:
    """Run ``step`` with the allocator recording every event (Python stacks) and return
    :func:`peak_breakdown` of its trace on ``device``, with ``complete``: False when the history
    overflowed ``max_entries`` (then the replay began mid-step and the groups are partial)."""
    import torch

    dev = torch.device(device)
    torch.cuda.synchronize(dev)
    baseline = torch.cuda.memory_allocated(dev)
    torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python", max_entries=max_entries,
                                             clear_history=True)
    try:
        step()
        torch.cuda.synchronize(dev)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(None)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    trace = snap["device_traces"][index]
    out = peak_breakdown(trace, baseline, top)
    out["complete"] = len(trace) < max_entries
    print(f"  memory at the step's peak: {out['peak_allocated'] / 2**30:.2f} GiB allocated "
          f"({len(trace)} events)", file=sys.stderr)
    return out
