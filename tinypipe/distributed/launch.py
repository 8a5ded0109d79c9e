"""Starting a process group the way ``torchrun`` expects (``env://``: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), for the ``tinypipe`` command; the Python API leaves this to the caller
(``torch.distributed.init_process_group`` before building the Engine)."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

WORLD_SIZE_VAR = "WORLD_SIZE"


def launched_with_ranks() -> bool:
    """Whether torchrun (or a hand-set environment) started this process as one of several ranks."""
    return int(os.environ.get(WORLD_SIZE_VAR, "1") or 1) > 1


def init_from_environment(timeout_s: float = 120.0) -> bool:
    """Initialise the default group from torchrun's environment when there is one and none exists;
    whether this process is one of several ranks. The default group is gloo: it carries only the
    rendezvous store and start-up traffic -- the engine makes its own groups (NCCL for CUDA
    gradients, :mod:`tinypipe.distributed.group`)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if not launched_with_ranks():
        return False
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    return True


def shutdown() -> None:
    """Leave the process group (every rank, at the end of a run)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
