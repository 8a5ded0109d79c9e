"""What offloading activations instead of recomputing could save (bench/benchkit/offload_limit.py and
bench/decompose.py's ``plan_offload_limit``): by hand on a small timeline, and on the recorded H200
step that the decision not to build the offload rests on."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchkit.keep_limit import KeepLimit
from benchkit.offload_limit import OffloadLimit, busy_within

ROOT = Path(__file__).resolve().parents[1]


def _decompose_module():
    spec = importlib.util.spec_from_file_location("decompose", ROOT / "bench" / "decompose.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


DEC = _decompose_module()


def ev(lane: str, name: str, start_s: float, dur_s: float, parent: str | None = None) -> dict:
    return {"lane": lane, "name": name, "start_us": start_s * 1e6, "dur_us": dur_s * 1e6, "parent": parent}


def _limit(bytes_per_block: float, blocks: int = 20) -> KeepLimit:
    return KeepLimit(budget_bytes=1 << 34, need_bytes=(1 << 33,), bytes_per_block=bytes_per_block,
                     keepable_blocks=0, num_blocks=blocks)


def test_busy_within_clips_intervals() -> None:
    assert busy_within([(0.0, 1.0), (2.0, 4.0)], 0.5, 3.0) == pytest.approx(1.5)
    assert busy_within([(0.0, 1.0)], 2.0, 3.0) == 0.0


def test_by_hand() -> None:
    """Forward 0-1 s (D2H busy 0.2 s of it, plus 0.3 s after it that does not count), head and
    backward 1-3 s (H2D busy 0.5 s); 10 GB/s each way, 1 GB per block: 8 GB idle down, 15 GB up
    -> 8 blocks of the 20 recomputed, each saving 2.0 s / 20."""
    events = [ev("dev0:compute", "fwd/0/0", 0.0, 1.0), ev("dev0:compute", "head/0", 1.0, 0.5),
              ev("dev0:compute", "bwd/0/0", 1.5, 1.5), ev("dev0:compute", "bwd/0/0/recompute", 1.5, 0.5, "bwd/0/0"),
              ev("dev0:d2h", "dl/L1", 0.1, 0.2), ev("dev0:d2h", "dl/L2", 1.2, 0.3),
              ev("dev0:h2d", "up/b0/L1", 1.5, 0.25), ev("dev0:h2d", "up/b0/L2", 1.6, 0.4)]  # overlapping: 0.5
    off = DEC.plan_offload_limit(events, 3.0, recompute_s=2.0, recomputed=20, limit=_limit(1e9),
                                 d2h_gbs=10.0, h2d_gbs=10.0, devices=1)
    assert off.forward_s == pytest.approx(1.0) and off.backward_s == pytest.approx(2.0)
    assert off.d2h_busy_forward_s == pytest.approx(0.2) and off.h2d_busy_backward_s == pytest.approx(0.5)
    assert off.idle_d2h_bytes == pytest.approx(8e9) and off.idle_h2d_bytes == pytest.approx(15e9)
    assert off.blocks == 8 and off.saved_s == pytest.approx(0.8)
    # the idle link can never offload more blocks than recompute
    few = DEC.plan_offload_limit(events, 3.0, recompute_s=2.0, recomputed=3, limit=_limit(1e9, 3),
                                 d2h_gbs=10.0, h2d_gbs=10.0, devices=1)
    assert few.blocks == 3 and few.saved_s == pytest.approx(2.0)


def test_the_slower_direction_limits() -> None:
    off = OffloadLimit(forward_s=1.0, backward_s=2.0, d2h_busy_forward_s=0.0, h2d_busy_backward_s=1.9, devices=1,
                       d2h_bytes_per_s=10e9, h2d_bytes_per_s=10e9, bytes_per_block=0.5e9, recompute_s=1.0,
                       recomputed_blocks=10)
    assert off.blocks == 2  # 1 GB of H2D idle in the backward, though 10 GB of D2H in the forward
    assert OffloadLimit(1.0, 1.0, 0.0, 0.0, 1, 1e9, 1e9, 0.0, 1.0, 10).blocks == 0  # nothing to size it by


def _trace_events(path: Path) -> list[dict]:
    """A Chrome trace (Engine.export_trace) back as timeline events; sub-spans are ``<task>/recompute``."""
    raw = json.loads(path.read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in raw if e.get("ph") == "M"}
    out = []
    for e in raw:
        if e.get("ph") != "X":
            continue
        parent = e["name"].rsplit("/recompute", 1)[0] if e["name"].endswith("/recompute") else None
        out.append({"lane": lanes[e["tid"]], "name": e["name"], "start_us": e["ts"], "dur_us": e["dur"],
                    "parent": parent})
    return out


def test_the_recorded_h200_step() -> None:
    """W1 at 24 GiB on the H200 (bench/results/s7_w1_final.*, nothing kept, 28 blocks recomputed):
    the forward's idle D2H carries at most a few of W1's 4.7 GB blocks, so offloading could save
    at most a few per cent of the step -- the reason it was not built (issue #16, session 7)."""
    run = json.loads((ROOT / "bench/results/s7_w1_final.json").read_text())
    events = _trace_events(ROOT / "bench/results/s7_w1_final.trace.json")
    step = run["decomposition"]["step_s"]
    lim = run["bound"]["keep_limit"]
    limit = KeepLimit(lim["budget_bytes"], tuple(lim["need_bytes"]), lim["bytes_per_block"], lim["keepable_blocks"],
                      lim["num_blocks"])
    off = DEC.plan_offload_limit(events, step, recompute_s=run["decomposition"]["parts"]["recompute"],
                                 recomputed=28, limit=limit, d2h_gbs=run["rates"]["d2h_gbs"],
                                 h2d_gbs=run["rates"]["h2d_gbs"], devices=1)
    assert off.forward_s == pytest.approx(run["decomposition"]["phases"]["forward"])
    assert 0 <= off.d2h_busy_forward_s < off.forward_s  # (the host stash is not on the D2H lane)
    assert off.idle_h2d_bytes > off.idle_d2h_bytes  # the forward's D2H is the short side
    assert 1 <= off.blocks <= 5 and off.saved_s / step < 0.05, off.as_dict()
