"""Everything one device entry owns: backend, streams, model shell, buffers, host gradient pool."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tinypipe.devices.backend import Backend
from tinypipe.memory.device_pool import DevicePool
from tinypipe.memory.grad_pool import HostGradPool
from tinypipe.models.decompose import Shell
from tinypipe.runtime.device_optimizer import DeviceAdamW


@dataclass
class DeviceRuntime:
    """One entry of ``Config.devices``; entries may name the same physical device."""

    index: int
    name: str
    backend: Backend
    shell: Shell
    pool: DevicePool
    grad_pool: HostGradPool
    streams: dict[str, object] = field(default_factory=dict)
    optim: DeviceAdamW | None = None  # AdamW state of resident layers kept on this device

    def __post_init__(self) -> None:
        for lane in ("compute", "h2d", "d2h", "stash_in", "stash_out"):
            self.streams[lane] = self.backend.new_stream()

    @property
    def device(self) -> torch.device:
        return self.backend.device
