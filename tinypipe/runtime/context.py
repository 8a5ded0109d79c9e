"""Per-step state: what exists for one step only, in one object the step's parts share.

The engine's resources (devices, host store, workers, the optimizer path) outlive the step:
:class:`~tinypipe.runtime.resources.EngineResources`. Everything here is created by
:meth:`~tinypipe.runtime.step.StepRunner.new_context` and dropped when the next step starts
(the engine keeps the last step's timings for its timeline).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from tinypipe.distributed.reduce import Reduction
from tinypipe.runtime.buffers import RowBuffer
from tinypipe.runtime.inputs import StepInputs
from tinypipe.runtime.optim.messages import GradStream
from tinypipe.runtime.signals import Abort, Signal
from tinypipe.schedule.ids import Lane, TaskId
from tinypipe.schedule.tasks import Schedule, Task


@dataclass
class TaskTiming:
    """When one task ran (host perf_counter seconds; CUDA timing events with ``trace=True``), or,
    with ``parent`` set, a traced sub-span inside that task (a backward's recompute) on its lane.
    Kept as data while the step runs; ``str()`` makes the timeline's text afterwards."""

    lane: Lane | str  # a schedule lane, or the trace name of a lane outside it (the SSD's ``ssd:read``)
    task: TaskId | str  # a task, or a span's name (a sub-span, a leftover update, SSD requests)
    host_start: float
    host_end: float
    events: tuple[object, object] | None = None
    parent: TaskId | None = None  # a sub-span's task; None for a task


@dataclass
class StepContext:
    """One step: the schedule and batch it runs, the pack-boundary buffers, the tasks' completion
    signals, the step-wide abort, each layer's gradient stream, and what the lanes record."""

    schedule: Schedule
    inputs: StepInputs
    acts: list[RowBuffer]  # pack q's input (q == num_packs: the head's), also the backward's stash
    grads: list[RowBuffer]  # the gradient of pack q's input
    signals: dict[TaskId, Signal]  # task -> set once its work is queued
    grad_streams: dict[int, GradStream]  # layer -> its download's messages to its update
    fault: Callable[[Task], None] | None = None  # test hook: called before every task
    abort: Abort = field(default_factory=Abort)
    timings: list[TaskTiming] = field(default_factory=list)
    # block arguments (masks, rotary embeddings) captured by the embedding forward, per device
    block_calls: dict[int, list] = field(default_factory=dict)
    block_calls_lock: threading.Lock = field(default_factory=threading.Lock)
    loss_sum: torch.Tensor | None = None  # fp64 on the head's device
    loss_value: float | None = None  # on the host, once the head's update read it
    side_streams: dict[Lane, list[object]] = field(default_factory=dict)  # lane -> its task's side streams
    current: dict[Lane, TaskId | None] = field(default_factory=dict)  # lane -> its task now (stall reports)
    stuck: str = ""  # lanes still inside a task when the step gave up on them
    reductions: dict[int, Reduction] = field(default_factory=dict)  # layer -> its replicas' reduction
