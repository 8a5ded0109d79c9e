"""Everything one device entry owns: backend, streams, model shell, buffers, host gradient pool."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tinypipe.devices.backend import Backend
from tinypipe.memory.device_pool import DevicePool
from tinypipe.memory.grad_pool import HostGradPool
from tinypipe.models.shell import Shell
from tinypipe.schedule.ids import Lane, compute_lane

#: Streams per device: the lanes' (compute, uploads, gradient downloads, replicas' gradient
#: collectives), the two side streams host-stashed activations move on (so compute never waits
#: for a stash transfer) and the two kept graphs in host memory move on (runtime/host_kept.py:
#: their gigabytes queued on the stash streams would hold up the next pack's input)
STREAMS = ("compute", "h2d", "d2h", "collective", "stash_in", "stash_out", "kept_in", "kept_out")


@dataclass
class DeviceRuntime:
    """One entry of ``Config.devices``; entries may name the same physical device. (The AdamW
    state of layers stepped on it belongs to :class:`~tinypipe.runtime.optim.path.OptimizerPath`.)"""

    index: int
    name: str
    backend: Backend
    shell: Shell
    pool: DevicePool
    grad_pool: HostGradPool
    streams: dict[str, object] = field(default_factory=dict)
    compute_lane: Lane = field(init=False)  # this device's compute lane (set from ``index``)

    def __post_init__(self) -> None:
        for name in STREAMS:
            self.streams[name] = self.backend.new_stream()
        self.compute_lane = compute_lane(self.index)

    @property
    def device(self) -> torch.device:
        return self.backend.device
