"""Cross-step resources: what every step uses and outlives it, in one object the engine builds.

Per-step state is :class:`~tinypipe.runtime.context.StepContext`; the step's parts (the runner,
the task handlers, the stash transfers) receive both explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tinypipe.distributed.group import Replicas
from tinypipe.memory.host_store import HostStore
from tinypipe.models.head_loss import HeadLoss
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.optim.path import OptimizerPath
from tinypipe.runtime.host_kept import HostKeptBuffers
from tinypipe.runtime.rng import DropoutRng
from tinypipe.runtime.ssd_stash import SsdStash
from tinypipe.runtime.stash_io import HostStash, ReadAheadBuffers
from tinypipe.runtime.workers import LaneWorkers


@dataclass
class KeptSaving:
    """Whether kept forwards save the compact set (models/compact.py). Switched off for the
    engine's life the first time a compact kept forward draws random numbers (dropout): the
    compact graph recomputes its elementwise ops, and could not replay the masks."""

    compact: bool = True


@dataclass
class EngineResources:
    """Devices, the host store and its optimizer path, the lane workers, the host stash and the
    read-ahead buffers, plus the settings every step reads."""

    devices: list[DeviceRuntime]
    store: HostStore
    optimizer: OptimizerPath
    workers: LaneWorkers  # one persistent thread per lane, reused by every step
    host_stash: HostStash
    read_ahead: ReadAheadBuffers
    compute_dtype: torch.dtype
    hidden_size: int
    head_chunk_tokens: int  # tokens per LM-head chunk (bounds the logits' memory)
    optimizer_threads: int | None  # OpenMP threads of the host optimizer lanes (None: torch's default)
    trace: bool  # record CUDA timing events per task
    check_finite: bool  # stop at the first task whose output holds NaN/inf (syncs)
    stall_timeout_s: float  # no task finished for this long: the watchdog aborts the step
    rng: DropoutRng | None = None  # training-mode randomness replayed by the recompute (None: dropout off)
    long_sequences: bool = False  # MLPs in chunks: boundary gradients may live in their host stash
    replicas: Replicas | None = None  # data-parallel replicas (torch.distributed); None: this one only
    # the head's loss and logit gradient (fused by Inductor on CUDA when the blocks compile)
    head_loss: HeadLoss = field(default_factory=lambda: HeadLoss(None))
    kept_saving: KeptSaving = field(default_factory=lambda: KeptSaving())
    # host buffers of kept graphs in host memory (Plan.kept_on_host), reused step after step
    host_kept: HostKeptBuffers = field(default_factory=lambda: HostKeptBuffers())
    # pack inputs stashed in the offload directory's files (Plan.stash_on_ssd; None: never built)
    ssd_stash: SsdStash | None = None
