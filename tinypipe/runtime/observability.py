"""What an engine tells its users about itself: memory by category, the last step's timeline."""

from __future__ import annotations

import resource
from dataclasses import dataclass

import psutil

from tinypipe.storage.stash_layout import STASH_STAGING_CATEGORY
from tinypipe.memory.report import CPU_DEVICE_POOLS, MemoryReport
from tinypipe.runtime.context import TaskTiming
from tinypipe.runtime.resources import EngineResources
from tinypipe.schedule.ids import Lane
from tinypipe.storage import IoRecord


class RssPeak:
    """The host RSS, sampled at the end of every step and by each memory report; its peak."""

    def __init__(self) -> None:
        self.peak = 0

    def sample(self) -> int:
        rss = psutil.Process().memory_info().rss
        self.peak = max(self.peak, rss)
        return rss


@dataclass
class StepTimeline:
    """The last step's task timings and the step's start (``time.perf_counter`` seconds)."""

    timings: list[TaskTiming]
    origin: float


def memory_report(res: EngineResources, rss: RssPeak) -> MemoryReport:
    """Host bytes by category, device bytes by category, and measured peaks."""
    store = res.store
    host = {
        "master_weights": store.master_bytes,
        **({store.frozen_label: store.frozen_bytes} if store.frozen_bytes else {}),
        "optimizer_state": store.optimizer_bytes,
        "pinned_grad_pool": sum(d.grad_pool.nbytes for d in res.devices),
        "gradient_buffers": res.optimizer.retained_bytes,
        "stashed_activations": res.host_stash.nbytes,
    }
    if res.ssd_stash is not None and res.ssd_stash.nbytes:  # pack inputs on the SSD: their staging pool
        host[STASH_STAGING_CATEGORY] = res.ssd_stash.nbytes
    if res.host_kept.nbytes:  # kept graphs waiting in host memory (Plan.kept_on_host)
        host["kept_activations"] = res.host_kept.nbytes
    tier = res.optimizer.tier
    if tier is not None:  # the SSD tier's DRAM: its staging pools (the state itself is on the SSD)
        host["ssd_staging_pool"] = tier.nbytes
    devices, peaks = {}, {}
    on_cpu = 0
    for d in res.devices:
        name = f"{d.index}:{d.name}"
        devices[name] = d.pool.bytes_by_category()
        on_device = res.optimizer.device_state_bytes(d.index)
        if on_device is not None:
            devices[name]["optimizer_state"] = on_device
        if not d.backend.is_cuda:
            on_cpu += sum(devices[name].values())
        stats = d.backend.memory_stats()
        if stats:
            static = sum(devices[name].values())
            devices[name]["activations_peak"] = max(0, stats["peak_allocated"] - static)
            peaks[name] = {"peak_allocated": stats["peak_allocated"], "peak_reserved": stats["peak_reserved"]}
    if on_cpu:  # a CPU device's pools are host memory (the planner counts them in the host budget)
        host[CPU_DEVICE_POOLS] = on_cpu
    now = rss.sample()
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return MemoryReport(host, devices, peaks, host_rss=now, host_rss_peak=max(rss.peak, peak_kb * 1024),
                        ssd=store.ssd_bytes())


def ssd_timings(records: list[IoRecord], origin: float) -> list[TaskTiming]:
    """The SSD tier's requests as lanes ``ssd:read`` / ``ssd:write``: requests that overlap (several
    are in flight at once) merged into one busy span, named by the layers it moved and its bytes
    -- spans on one lane never overlap, as trace viewers need."""
    out: list[TaskTiming] = []
    for op in ("read", "write"):
        spans: list[list] = []  # [start, end, bytes, layers]
        for r in sorted((r for r in records if r.op == op and r.error is None), key=lambda r: r.started):
            start = max(r.started, origin)  # in flight when the step began: drawn from its start
            if spans and start <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], r.finished)
                spans[-1][2] += r.nbytes
            else:
                spans.append([start, r.finished, r.nbytes, []])
            layer = r.key[0] if isinstance(r.key, tuple) else r.key
            if layer not in spans[-1][3]:
                spans[-1][3].append(layer)
        for start, end, nbytes, layers in spans:
            names = ",".join(f"L{x}" for x in layers[:6]) + ("..." if len(layers) > 6 else "")
            out.append(TaskTiming(f"ssd:{op}", f"{op} {names} ({nbytes / 1e6:.1f} MB)", start, end))
    return out


def host_times(timings: list[TaskTiming], origin: float) -> list[dict]:
    """Timings as trace events (microseconds since ``origin``); a sub-span's event also names
    its task (``"parent"``). Lanes and task ids become their text here."""
    out = []
    for t in timings:
        e = {
            "lane": str(t.lane),
            "name": str(t.task),
            "start_us": (t.host_start - origin) * 1e6,
            "dur_us": (t.host_end - t.host_start) * 1e6,
        }
        if t.parent is not None:
            e["parent"] = str(t.parent)
        out.append(e)
    return out


def timeline_events(last: StepTimeline | None, device_times: bool) -> list[dict]:
    """``last``'s tasks as ``{"lane", "name", "start_us", "dur_us"}``: host times, or with
    ``device_times`` the CUDA tasks' device times (aligned per device); empty before a step.
    Traced steps add their sub-spans (``"<task id>/recompute"``, with ``"parent"``: the task id)
    on their task's lane, inside their task's span."""
    if last is None:
        return []
    events = host_times(last.timings, last.origin)
    return _device_events(last.timings, events) if device_times else events


def _device_events(timings: list[TaskTiming], host_events: list[dict]) -> list[dict]:
    """Replace host times of CUDA tasks with their device times (aligned per device)."""
    firsts: dict[int | None, tuple[object, float]] = {}
    out = []
    for t, h in zip(timings, host_events):
        if t.events is None:
            out.append(h)
            continue
        ev0, ev1 = t.events
        # events of one device share one time base (only a schedule lane's tasks have events)
        dev = t.lane.device if isinstance(t.lane, Lane) else None
        if dev not in firsts:
            firsts[dev] = (ev0, h["start_us"])
        ref, ref_us = firsts[dev]
        start = ref_us + ref.elapsed_time(ev0) * 1000.0  # type: ignore[attr-defined]
        dur = ev0.elapsed_time(ev1) * 1000.0  # type: ignore[attr-defined]
        out.append(dict(h, start_us=start, dur_us=dur))
    return out
