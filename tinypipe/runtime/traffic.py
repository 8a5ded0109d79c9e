"""Bytes a step moves over the host<->device link, from its schedule (for GB/s in the metrics).

Counted per task: an upload moves a layer's fp32 master (cast on the device) plus its frozen
weights at compute precision; a download moves the fp32 gradient of its trainable part; each
host-stashed pack input is written down once in the forward and read back up in the forward and
the backward. CPU "devices" move nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinypipe.memory.host_store import HostStore
from tinypipe.schedule.tasks import Kind, Schedule


@dataclass(frozen=True)
class Traffic:
    h2d_bytes: int
    d2h_bytes: int


def step_traffic(sched: Schedule, store: HostStore, seq: int, hidden: int, act_bytes: int,
                 frozen_bytes: int, on_device: set[int] | frozenset[int] = frozenset()) -> Traffic:
    """Bytes up and down for one step of ``sched`` (``act_bytes`` per activation element,
    ``frozen_bytes`` per frozen weight element). Layers in ``on_device`` are stepped on their
    device: after their first upload neither weights nor gradients move."""
    up = down = 0
    for task in sched.tasks.values():
        if task.layers and task.layers[0] in on_device:
            continue
        if task.kind in (Kind.UPLOAD, Kind.RESIDENT_UPLOAD):
            spec = store.layers[task.layers[0]].spec
            up += spec.train_numel * 4 + spec.frozen_numel * frozen_bytes
        elif task.kind is Kind.DOWNLOAD:
            down += store.layers[task.layers[0]].spec.train_numel * 4
    boundary = sched.batch * seq * hidden * act_bytes
    for q, on_host in enumerate(sched.plan.stash_on_host):
        if q > 0 and on_host:
            down += boundary
            up += 2 * boundary if q < sched.plan.num_packs else boundary
    return Traffic(up, down)
