"""What an engine tells its users about itself: memory by category, the last step's timeline."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import psutil

from tinypipe.errors import ConfigError
from tinypipe.memory.report import MemoryReport
from tinypipe.runtime.step import host_times
from tinypipe.schedule.render import chrome_trace, to_text


class EngineObservability:
    """Mixed into :class:`~tinypipe.runtime.engine.Engine` (uses its store, devices, plan and the
    last step's state)."""

    def _sample_rss(self) -> int:
        rss = psutil.Process().memory_info().rss
        self._rss_peak = max(self._rss_peak, rss)
        return rss

    def memory_report(self) -> MemoryReport:
        """Host bytes by category, device bytes by category, and measured peaks."""
        grad_pool = sum(d.grad_pool.nbytes for d in self.devices)
        stash = sum(t.numel() * t.element_size() for t in self._host_stash.values())
        retained = sum(t.numel() * 4 for t in (self._retained or {}).values())
        host = {
            "master_weights": self.store.master_bytes,
            **({"frozen_weights": self.store.frozen_bytes} if self.store.frozen_bytes else {}),
            "optimizer_state": self.store.optimizer_bytes,
            "pinned_grad_pool": grad_pool,
            "gradient_buffers": retained,
            "stashed_activations": stash,
        }
        devices, peaks = {}, {}
        for d in self.devices:
            name = f"{d.index}:{d.name}"
            devices[name] = d.pool.bytes_by_category()
            if d.optim is not None:
                devices[name]["optimizer_state"] = d.optim.nbytes
            stats = d.backend.memory_stats()
            if stats:
                static = sum(devices[name].values())
                devices[name]["activations_peak"] = max(0, stats["peak_allocated"] - static)
                peaks[name] = {"peak_allocated": stats["peak_allocated"], "peak_reserved": stats["peak_reserved"]}
        rss = self._sample_rss()
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return MemoryReport(host, devices, peaks, host_rss=rss, host_rss_peak=max(self._rss_peak, peak_kb * 1024))

    def schedule_text(self, batch: int) -> str:
        return to_text(self.schedule_for(batch))

    def step_timeline(self) -> list[dict]:
        """The last step's tasks as ``{"lane", "name", "start_us", "dur_us"}`` (device times for CUDA
        tasks when ``trace=True``, else host times); empty before the first step."""
        if self._last_state is None:
            return []
        events = host_times(self._last_state.timings, self._last_origin)
        return self._device_events(events) if self.config.trace else events

    def export_trace(self, path: str | os.PathLike) -> Path:
        """Chrome/Perfetto trace of the last step (per lane; device times when ``trace=True``)."""
        if self._last_state is None:
            raise ConfigError("no step has run yet: nothing to trace")
        events = host_times(self._last_state.timings, self._last_origin)
        if self.config.trace:
            events = self._device_events(events)
        return chrome_trace(events, path)

    def _device_events(self, host_events: list[dict]) -> list[dict]:
        """Replace host times of CUDA tasks with their device times (aligned per device)."""
        timings = self._last_state.timings if self._last_state else []
        firsts: dict[str, tuple[object, float]] = {}
        out = []
        for t, h in zip(timings, host_events):
            if t.events is None:
                out.append(h)
                continue
            ev0, ev1 = t.events
            dev = t.lane.split(":")[0]  # events of one device share one time base
            if dev not in firsts:
                firsts[dev] = (ev0, h["start_us"])
            ref, ref_us = firsts[dev]
            start = ref_us + ref.elapsed_time(ev0) * 1000.0  # type: ignore[attr-defined]
            dur = ev0.elapsed_time(ev1) * 1000.0  # type: ignore[attr-defined]
            out.append(dict(h, start_us=start, dur_us=dur))
        return out

