"""PNG plots of a run: loss and throughput per step; memory, link traffic and the last step's lanes.

Drawn with matplotlib's Agg canvas on a private Figure (no pyplot, no global backend change), so
plotting works headless and never disturbs a user's own matplotlib state.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import MappingProxyType

from tinypipe.schedule.ids import Lane

GIB = 1024**3
#: Colours of a schedule lane, by its ``Lane.name`` (a device stream or a host worker).
LANE_COLOURS = MappingProxyType({"compute": "tab:blue", "h2d": "tab:green", "d2h": "tab:orange",
                                 "optimizer": "tab:red", "deferred-optimizer": "tab:red",
                                 "collective": "tab:cyan"})
#: Colours of the SSD tier's trace lanes (no lanes of a schedule), by their text.
SSD_LANE_COLOURS = MappingProxyType({"ssd:read": "tab:purple", "ssd:write": "tab:brown"})


def _figure(width: float, height: float):  # noqa: ANN202 - matplotlib types
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_metrics(records: list[dict], out_png: str | os.PathLike[str]) -> Path:
    """Loss (with the held-out loss where it was evaluated) and tokens/s per step into ``out_png``."""
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in records]
    fig = _figure(9, 3.6)
    ax_loss, ax_tps = fig.subplots(1, 2)
    ax_loss.plot(steps, [r["loss"] for r in records], marker="o", markersize=3, color="tab:blue",
                 label="training")
    held = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    if held:
        ax_loss.plot([s for s, _ in held], [v for _, v in held], marker="s", markersize=5,
                     color="tab:red", label="held-out")
        ax_loss.legend()
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss")
    ax_loss.grid(True, alpha=0.3)
    ax_tps.plot(steps, [r["tokens_per_s"] for r in records], marker="o", markersize=3, color="tab:green")
    ax_tps.set_xlabel("step")
    ax_tps.set_ylabel("tokens / s")
    ax_tps.set_title("throughput")
    ax_tps.set_ylim(bottom=0)
    ax_tps.grid(True, alpha=0.3)
    fig.savefig(out)
    return out


def _lane_colour(lane: str) -> str:
    """The colour of a timeline event's lane (its text: the timeline is read back here)."""
    try:
        name = Lane.parse(lane).name
    except ValueError:
        return SSD_LANE_COLOURS.get(lane, "tab:gray")
    return LANE_COLOURS.get(name, "tab:gray")


def plot_timeline(records: list[dict], events: list[dict], out_png: str | os.PathLike[str]) -> Path:
    """Memory and transfer timeline into ``out_png``: host RSS and GPU peaks per step, host<->device
    GB/s per step (and the SSD tier's), and the last step's lanes (compute, uploads, downloads, CPU
    optimizer, SSD reads and writes) as bars over time -- where overlap happens and where a lane
    waits."""
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in records]
    fig = _figure(11, 7.5)
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.2])
    ax_mem, ax_link = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    ax_lanes = fig.add_subplot(grid[1, :])

    ax_mem.plot(steps, [r.get("rss_bytes", 0) / GIB for r in records], marker="o", markersize=3,
                label="host RSS")
    if any(r.get("gpu_peak_reserved") for r in records):
        ax_mem.plot(steps, [r.get("gpu_peak_reserved", 0) / GIB for r in records], marker="o", markersize=3,
                    label="GPU peak reserved")
        ax_mem.plot(steps, [r.get("gpu_peak_allocated", 0) / GIB for r in records], marker="o", markersize=3,
                    label="GPU peak allocated")
    ax_mem.set_xlabel("step")
    ax_mem.set_ylabel("GiB")
    ax_mem.set_title("memory per step")
    ax_mem.set_ylim(bottom=0)
    ax_mem.grid(True, alpha=0.3)
    ax_mem.legend(fontsize=8)

    link, ssd = any(r.get("h2d_gbs") for r in records), any("ssd_read_gbs" in r for r in records)
    if link:
        ax_link.plot(steps, [r.get("h2d_gbs", 0.0) for r in records], marker="o", markersize=3,
                     color="tab:green", label="host -> device")
        ax_link.plot(steps, [r.get("d2h_gbs", 0.0) for r in records], marker="o", markersize=3,
                     color="tab:orange", label="device -> host")
    if ssd:  # the SSD tier: GB/s while its requests were in flight
        ax_link.plot(steps, [r.get("ssd_read_gbs", 0.0) for r in records], marker="s", markersize=3,
                     color="tab:purple", label="SSD read")
        ax_link.plot(steps, [r.get("ssd_write_gbs", 0.0) for r in records], marker="s", markersize=3,
                     color="tab:brown", label="SSD write")
    if link or ssd:
        ax_link.legend(fontsize=8)
        ax_link.set_ylim(bottom=0)
    else:
        ax_link.text(0.5, 0.5, "no host<->device link (CPU run)", ha="center", va="center",
                     transform=ax_link.transAxes)
    ax_link.set_xlabel("step")
    ax_link.set_ylabel("GB/s (step average)")
    ax_link.set_title("link traffic per step")
    ax_link.grid(True, alpha=0.3)

    lanes = sorted({e["lane"] for e in events})
    for row, lane in enumerate(lanes):
        spans = [(e["start_us"] / 1e3, e["dur_us"] / 1e3) for e in events if e["lane"] == lane]
        ax_lanes.broken_barh(spans, (row - 0.4, 0.8), facecolors=_lane_colour(lane))
    ax_lanes.set_yticks(range(len(lanes)), lanes)
    ax_lanes.set_xlabel("ms since the step began")
    ax_lanes.set_title("last step: what each lane was doing" if events else "last step: no timings recorded")
    ax_lanes.grid(True, axis="x", alpha=0.3)
    fig.savefig(out)
    return out
