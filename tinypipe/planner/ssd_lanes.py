"""The SSD tier's traffic (:mod:`tinypipe.planner.offload`) as lanes beside the step's phases."""

from __future__ import annotations

from tinypipe.errors import ConfigError
from tinypipe.planner.hardware import HardwareSpec
from tinypipe.planner.offload import SsdTraffic


#: Why the SSD's reads and writes share one lane unless the disk's mixed rate says otherwise: a disk
#: shares its bandwidth between the two directions, and how far they overlap differs from disk to
#: disk -- measured, one lent machine's disk took the serial time, another's moved both in less
#: (docs/measured.md). Only a measured mixed rate lets the plan count on overlap.
SSD_SHARED_NOTE = "one disk serves reads and writes"


class SsdLanes:
    """The SSD as two lanes, reads and writes, each at its measured rate (``tinypipe profile``
    measures them separately, the way the tier's worker threads issue them: several requests in
    flight). Each phase of the step is as slow as its slowest lane, the SSD's included: the first
    reads of the embedding, head and first pack lengthen the fill; the other packs' first reads
    run beside the forward; second reads, moment reads and the write-backs of layers stepped
    during the backward beside the backward; the master write-backs of the tail's layers beside
    the tail's AdamW, their moment and gradient write-backs beside the next step's forward (steady
    state: the previous step's land beside this one's). A clipped step's backward moves only
    upload reads and gradients; the moment, gradient and master traffic of its redo pass runs
    beside the next forward, with that forward's reads."""

    def __init__(self, traffic: SsdTraffic, hw: HardwareSpec) -> None:
        self.t = traffic
        self.on = bool(traffic.read_bytes or traffic.write_bytes)
        if self.on and not (hw.ssd_read_gbps and hw.ssd_write_gbps):
            raise ConfigError(f"the plan keeps state on the SSD but hardware {hw.name!r} states no "
                              "ssd_read_gbps / ssd_write_gbps (tinypipe profile --offload-dir measures them)")
        self.read = (hw.ssd_read_gbps or 1.0) * 1e9
        self.write = (hw.ssd_write_gbps or 1.0) * 1e9
        self.mixed = hw.ssd_mixed_gbps * 1e9 if hw.ssd_mixed_gbps else None

    def both(self, read_bytes: float, write_bytes: float) -> float:
        """Seconds to read and write these bytes with both in flight (one phase's SSD lane).

        With the disk's mixed rate measured: :meth:`overlapped`, never above the serial time.
        Unknown: the serial time (one direction after the other), what a disk that shares its
        bandwidth between them takes -- never an optimistic guess."""
        serial = read_bytes / self.read + write_bytes / self.write
        return serial if self.mixed is None else min(serial, self.overlapped(read_bytes, write_bytes))

    def overlapped(self, read_bytes: float, write_bytes: float) -> float:
        """No faster than either direction alone, nor (mixed rate measured) than their sum at it."""
        floor = max(read_bytes / self.read, write_bytes / self.write)
        return floor if self.mixed is None else max(floor, (read_bytes + write_bytes) / self.mixed)

    def clipped(self, no_opt: float, host_pass: float, f_terms: dict[str, float]) -> tuple[float, float]:
        """(backward, background pass) of a step where clipping triggers, with the SSD's share."""
        t = self.t
        upload_reads = t.backward_read - t.step_read
        backward = max(no_opt, self.overlapped(upload_reads, t.grad_bytes))
        redo_read = t.step_read + t.grad_bytes + t.master_bytes
        redo_write = t.step_write
        pass_s = max(host_pass, self.overlapped(t.forward_read + redo_read, redo_write))
        return backward, max(pass_s, max(f_terms.values()))
