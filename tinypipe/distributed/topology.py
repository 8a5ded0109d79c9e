"""Who this process is among the replicas: rank, world size, local rank, and which local devices
its replica drives. Read from an initialised process group (and ``torchrun``'s LOCAL_* variables),
never at import time."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from tinypipe.errors import BatchError


@dataclass(frozen=True)
class Topology:
    """One replica per rank; a replica is one engine over ``len(Config.devices)`` local devices."""

    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def from_process_group(cls, single_rank: bool = False) -> Topology | None:
        """The default group's view (None when torch.distributed is not initialised or has one rank).

        ``single_rank``: a one-rank group is one replica too -- the whole replica machinery (the
        reduction lanes, the sharded optimizer's collectives, the sharded checkpoint) runs over it,
        which is how one GPU exercises the NCCL path (NCCL refuses two ranks on one GPU).
        LOCAL_RANK / LOCAL_WORLD_SIZE come from torchrun; without them (a hand-started group) every
        rank is taken to be on its own node, which only matters for CUDA device numbering."""
        if not dist.is_available() or not dist.is_initialized():
            return None
        world = dist.get_world_size()
        if world == 1 and not single_rank:
            return None
        rank = dist.get_rank()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return cls(rank, world, local, local_world)

    @property
    def is_main(self) -> bool:
        """Rank 0 prints, writes metrics and plots, saves the model and commits checkpoints."""
        return self.rank == 0

    def local_devices(self, devices: list[str], share: bool = False) -> list[str]:
        """``devices`` as this rank's replica uses them: ``cuda:i`` becomes
        ``cuda:(local_rank * G + i)`` with G the replica's CUDA entries, so ``--devices cuda:0`` under
        ``torchrun --nproc-per-node 2`` trains on cuda:0 and cuda:1 (NCCL refuses two ranks on one
        GPU). ``share``: keep the names (several ranks on one GPU, gloo -- the one-GPU fallback)."""
        cuda = [d for d in devices if d.startswith("cuda")]
        if share or not cuda or self.local_world_size == 1:
            return list(devices)
        per = len({d for d in cuda})
        out = []
        for d in devices:
            if not d.startswith("cuda"):
                out.append(d)
                continue
            index = int(d.partition(":")[2] or 0)
            out.append(f"cuda:{self.local_rank * per + index}")
        return out

    def split_rows(self, batch: int) -> tuple[int, int]:
        """This replica's rows ``[lo, hi)`` of a global batch of ``batch`` sequences (even split;
        a batch that does not divide is refused, naming the sizes that would)."""
        R = self.world_size
        if batch % R:
            lower, upper = (batch // R) * R, (batch // R + 1) * R
            fits = f"{lower} or {upper}" if lower else f"{upper}"
            raise BatchError(f"global batch of {batch} sequences does not divide over {R} replicas: "
                              f"use a multiple of {R} ({fits})")
        per = batch // R
        return self.rank * per, (self.rank + 1) * per
