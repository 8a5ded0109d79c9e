"""Host DRAM traffic of the forward that follows a clipped step, and the floor it puts on it (#16).

When clipping triggers, every host-stepped layer's AdamW waits for the global norm and runs ahead
of the next forward, which follows it layer by layer (:mod:`tinypipe.planner.clipped`); the
layers in ``Plan.assisted`` make a round trip to their device instead. Everything then in flight
reads or writes host memory at once: the host pass (:data:`ADAMW_DRAM_BYTES` per parameter), the
uploads, the assisted round trips and the host-stashed activations' moves. Measured, their sum
stays near one rate however it is split between the CPU and the DMA engines (the ``h200-pcie5``
preset's ``host_dram_gbs``; two benchmarks, docs/measured.md).

So that forward lasts at least ``bytes / DRAM rate``: whether the host or the GPU steps a layer,
its state crosses host memory (28 B/param either way, plus the host-stepped layer's 4 B/param
upload); only state that lives on the GPU (resident packs, ``device_optimizer``) stays out of it.
:func:`clipped_forward_dram` counts the bytes of a plan; the cost model's clipped step is at least
that long where the hardware states ``host_dram_gbs``; ``bench/archive/dram_window.py`` checks the floor
against measured clipped steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from tinypipe.planner.assist import ASSIST_DOWN_BYTES, ASSIST_UP_BYTES
from tinypipe.planner.sizes import ModelSizes
from tinypipe.schedule.plan import Plan, host_stashed_inputs

#: Host memory one fused AdamW step on fp32 moves per parameter: master, both moments and the
#: gradient read (16 B), master and moments written (12 B).
ADAMW_DRAM_BYTES = 28


@dataclass(frozen=True)
class DramWindow:
    """Trainable elements the host steps and the device steps after a clipped step, and the host
    DRAM bytes the next forward moves: the host pass, the uploads, the assisted round trips and
    the host-stashed activations written down and read back."""

    host_stepped: int
    assisted: int
    bytes: int

    def seconds(self, dram_gbs: float) -> float:
        """The floor on that forward at ``dram_gbs`` GB/s."""
        return self.bytes / (dram_gbs * 1e9)


def clipped_forward_dram(sizes: ModelSizes, plan: Plan, *, stash_bytes: int, upload_bytes: int,
                         frozen_bytes: int = 2, assisted: Iterable[int] | None = None,
                         long_sequences: bool = False) -> DramWindow:
    """The DRAM window of ``plan`` (module docstring): layers stepped on their device (resident
    packs, ``device_optimizer``) move nothing; a host-stepped layer's trainable elements go up at
    ``upload_bytes`` each (the cost model's ``UPLOAD_BYTES``), frozen ones at ``frozen_bytes``;
    ``stash_bytes``: one host-stashed pack input (tokens x hidden x the compute element size);
    ``assisted``: the layers stepped on their device instead of ``plan.assisted`` (a chooser's
    candidate set, without a copy of the plan); ``long_sequences``: the MLPs run in chunks (the
    embedding's output may be host-stashed too, :func:`~tinypipe.schedule.plan.host_stashed_inputs`)."""
    on_device = set().union(*(plan.device_optimized(d) for d in range(plan.num_devices)))
    assisted = set(plan.assisted if assisted is None else assisted)
    host = dev = total = 0
    for layer, (numel, train) in enumerate(zip(sizes.layer_numels, sizes.layer_train_numels)):
        if layer in on_device:
            continue
        total += (numel - train) * frozen_bytes
        if layer in assisted:
            dev += train
            total += train * (ASSIST_UP_BYTES + ASSIST_DOWN_BYTES)
        else:
            host += train
            total += train * (ADAMW_DRAM_BYTES + upload_bytes)
    stashed = sum(host_stashed_inputs(plan, long_sequences))
    total += stashed * 2 * stash_bytes  # written down, read back up
    return DramWindow(host_stepped=host, assisted=dev, bytes=total)
