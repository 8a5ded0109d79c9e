"""The SSD tier's traffic (:mod:`tinypipe.planner.offload`) as lanes beside the step's phases."""

from __future__ import annotations

from tinypipe.errors import ConfigError
from tinypipe.planner.hardware import HardwareSpec
from tinypipe.planner.offload import SsdTraffic


#: Why the SSD's reads and writes are one lane, not two: a disk shares its bandwidth between the two
#: directions. Measured, a step that read and wrote took the serial time, not the longer of the two
#: (docs/measured.md).
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

    def clipped(self, no_opt: float, host_pass: float, f_terms: dict[str, float]) -> tuple[float, float]:
        """(backward, background pass) of a step where clipping triggers, with the SSD's share."""
        t = self.t
        upload_reads = t.backward_read - t.step_read
        backward = max(no_opt, upload_reads / self.read, t.grad_bytes / self.write)
        redo_read = t.step_read + t.grad_bytes + t.master_bytes
        redo_write = t.step_write
        pass_s = max(host_pass, (t.forward_read + redo_read) / self.read, redo_write / self.write)
        return backward, max(pass_s, max(f_terms.values()))
