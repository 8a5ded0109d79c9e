"""Byte-exact memory accounting shared by the runtime's report and the planner."""

from __future__ import annotations

from dataclasses import dataclass, field

from tinypipe.units import GIB, fmt_bytes  # noqa: F401 - re-exported (planner, tests)

#: The host category of CPU device entries' preallocated pools (slots, gradient accumulators,
#: resident layers): host memory, so the host budget holds them; each device's row lists them too.
CPU_DEVICE_POOLS = "cpu_device_pools"


@dataclass
class MemoryReport:
    """Host bytes by category, device bytes by category per device entry, and measured peaks."""

    host: dict[str, int]
    devices: dict[str, dict[str, int]]
    device_peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    host_rss: int | None = None
    host_rss_peak: int | None = None
    ssd: dict[str, int] = field(default_factory=dict)  # bytes on the SSD tier per kind of state

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    def device_total(self, name: str) -> int:
        """Static (preallocated) bytes on a device; measured activation peaks are not included."""
        return sum(v for k, v in self.devices[name].items() if not k.endswith("_peak"))

    def as_dict(self) -> dict:
        return {
            "host": dict(self.host, total=self.host_total),
            "devices": {k: dict(v, total=self.device_total(k)) for k, v in self.devices.items()},
            "device_peaks": self.device_peaks,
            "host_rss": self.host_rss,
            "host_rss_peak": self.host_rss_peak,
            **({"ssd": dict(self.ssd, total=sum(self.ssd.values()))} if self.ssd else {}),
        }

    def to_text(self) -> str:
        lines = ["host memory (tinypipe-owned):"]
        for k, v in self.host.items():
            lines.append(f"  {k:<24} {fmt_bytes(v):>12}")
        lines.append(f"  {'total':<24} {fmt_bytes(self.host_total):>12}")
        if self.host_rss is not None:
            lines.append(f"  {'process RSS (now)':<24} {fmt_bytes(self.host_rss):>12}")
        if self.host_rss_peak is not None:
            lines.append(f"  {'process RSS (peak)':<24} {fmt_bytes(self.host_rss_peak):>12}")
        if self.ssd:
            lines.append("on SSD (offload directory):")
            for k, v in self.ssd.items():
                lines.append(f"  {k:<24} {fmt_bytes(v):>12}")
            lines.append(f"  {'total':<24} {fmt_bytes(sum(self.ssd.values())):>12}")
        for name, cats in self.devices.items():
            lines.append(f"device {name}:")
            for k, v in cats.items():
                lines.append(f"  {k:<24} {fmt_bytes(v):>12}")
            lines.append(f"  {'total (static)':<24} {fmt_bytes(self.device_total(name)):>12}")
            for k, v in self.device_peaks.get(name, {}).items():
                lines.append(f"  {k:<24} {fmt_bytes(v):>12}")
        return "\n".join(lines)
