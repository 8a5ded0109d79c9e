"""What the SSD tier shows: ``ssd:read`` / ``ssd:write`` lanes in the Chrome trace and timeline.png,
per-step SSD bytes and GB/s in StepResult, metrics records and the progress bar, the staging pool
and the bytes on the SSD per kind in the memory report -- and nothing of it without the tier."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import tinypipe
from model_zoo import make_batch, make_model
from tinypipe.planner.auto import manual_plan
from tinypipe.train.loop import _run_step, _show_progress
from tinypipe.train.plots import plot_timeline


def _engine(ssd: Path | None) -> tinypipe.Engine:
    cfg = tinypipe.Config(pack_size=2, micro_batch_size=2, lr=1e-3, offload_dir=str(ssd) if ssd else None)
    plan = manual_plan(cfg, num_blocks=4, tied=False)
    if ssd is not None:
        plan = dataclasses.replace(plan, offload=tuple((layer, "moments") for layer in range(6))
                                   + ((2, "master"),))
    return tinypipe.Engine(make_model("llama"), cfg, plan=plan)


class _Bar:
    def __init__(self) -> None:
        self.text = ""

    def set_postfix_str(self, text: str, refresh: bool = False) -> None:
        self.text = text

    def update(self, n: int) -> None:
        pass


def test_ssd_lanes_bytes_and_memory_rows(tmp_path: Path) -> None:
    import psutil

    (tmp_path / "ssd").mkdir()
    engine = _engine(tmp_path / "ssd")
    records = [_run_step(engine, make_batch(4, 12, seed=i), 1e-3, i, 0, psutil.Process()) for i in range(3)]
    moments = sum(s.spec.train_numel * 8 for s in engine.store.layers)
    master2 = engine.store.layers[2].spec.train_numel * 4
    last = records[-1]
    # per step: the moments read once and written once, block 2's master read twice and written once
    # (a write-back may land just after its step: it counts in the next)
    assert last["ssd_read_bytes"] == moments + 2 * master2
    assert abs(last["ssd_write_bytes"] - (moments + master2)) <= moments
    assert last["ssd_read_gbs"] > 0 and last["ssd_write_gbs"] > 0
    bar = _Bar()
    _show_progress(bar, last)
    assert " ssd r=" in bar.text and "GB/s" in bar.text

    trace = json.loads(engine.export_trace(tmp_path / "t.json").read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in trace:
        if e["ph"] == "X":
            spans.setdefault(names[e["tid"]], []).append((e["ts"], e["ts"] + e["dur"]))
    assert {"ssd:read", "ssd:write"} <= set(spans)
    for lane in ("ssd:read", "ssd:write"):  # merged busy spans: never overlapping on one lane
        ordered = sorted(spans[lane])
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(ordered, ordered[1:])), lane
    png = plot_timeline(records, engine.step_timeline(), tmp_path / "timeline.png")
    assert png.stat().st_size > 10_000

    report = engine.memory_report()
    assert report.ssd == {"master": master2, "moments": moments}
    assert report.host["ssd_staging_pool"] == engine.optimizer.tier.nbytes > 0
    assert report.host["optimizer_state"] == 0
    assert report.host["master_weights"] == sum(s.spec.train_numel * 4 for s in engine.store.layers) - master2
    text = report.to_text()
    assert "on SSD (offload directory):" in text and "ssd_staging_pool" in text
    assert report.as_dict()["ssd"]["total"] == master2 + moments
    engine.close()


def test_nothing_of_it_without_the_tier(tmp_path: Path) -> None:
    import psutil

    engine = _engine(None)
    record = _run_step(engine, make_batch(4, 12), 1e-3, 0, 0, psutil.Process())
    assert not any(k.startswith("ssd") for k in record)
    assert engine.optimizer.tier is None and engine.store.offload is None
    report = engine.memory_report()
    assert report.ssd == {} and "ssd_staging_pool" not in report.host and "on SSD" not in report.to_text()
    assert not any(e["lane"].startswith("ssd") for e in engine.step_timeline())
    engine.close()
