"""Bytes a step moves over the host<->device link, from its schedule (for GB/s in the metrics).

Counted per task: an upload moves a layer's fp32 master (cast on the device) plus its frozen
weights at compute precision; a download moves the fp32 gradient of its trainable part; each
host-stashed pack input (at long sequences the embedding's output too:
:func:`~tinypipe.schedule.plan.host_stashed_inputs`) is written down once in the forward and read
back up in the forward and the backward; a boundary gradient in its stash's rows (long sequences,
:func:`~tinypipe.schedule.plan.host_gradient_boundaries`) is written down once and read back up
once, both in the backward. CPU "devices" move nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinypipe.memory.host_store import HostStore
from tinypipe.schedule.plan import host_gradient_boundaries, host_stashed_inputs
from tinypipe.schedule.tasks import Kind, Schedule


@dataclass(frozen=True)
class Traffic:
    h2d_bytes: int
    d2h_bytes: int


def step_traffic(sched: Schedule, store: HostStore, seq: int, hidden: int, act_bytes: int,
                 frozen_bytes: int, on_device: set[int] | frozenset[int] = frozenset(),
                 long_sequences: bool = False) -> Traffic:
    """Bytes up and down for one step of ``sched`` (``act_bytes`` per activation element,
    ``frozen_bytes`` per frozen weight element). Layers in ``on_device`` are stepped on their
    device: after their first upload neither weights nor gradients move. ``long_sequences``: the
    MLPs run in chunks (the embedding's output and boundary gradients may live in host memory)."""
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
    for q, on_host in enumerate(host_stashed_inputs(sched.plan, long_sequences)):
        if on_host:
            down += boundary
            up += 2 * boundary if q < sched.plan.num_packs else boundary
    for on_host in host_gradient_boundaries(sched.plan, long_sequences):
        if on_host:
            down += boundary
            up += boundary
    return Traffic(up, down)
