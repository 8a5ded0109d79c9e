"""One layer's gradient reduction across replicas, issued by its device's collective lane as soon
as the layer's backward is done; the layer's download waits on it (so the reduction overlaps
the next layer's backward, and only the download is held back)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tinypipe.distributed.collectives import Collectives, Pending
from tinypipe.distributed.shards import Shard


@dataclass
class Reduction:
    """A reduction in flight: wait, then ``[lo, hi)`` of the accumulator holds the summed gradient
    (all of it, or this rank's shard) and, sharded, ``norm_sq`` the whole layer's squared norm."""

    pending: Pending
    lo: int
    hi: int
    norm_sq: torch.Tensor | None = None  # fp64, on the gradient's device (sharded only)

    def wait(self) -> None:
        self.pending.wait()


def reduce_gradient(coll: Collectives, acc: torch.Tensor, n: int, shard: Shard | None,
                    norm: Callable[[torch.Tensor], torch.Tensor]) -> Reduction:
    """Sum ``acc[:n]`` over the replicas: all of it (``shard`` None), or reduce-scatter to this
    rank's shard and all-reduce the shards' squared norms (``norm``: the download's fp64 norm of a
    flat fp32 range), so every rank decides clipping and non-finite skips on the same number."""
    if shard is None:
        return Reduction(coll.all_reduce(acc[:n]), 0, n)
    scattered = coll.reduce_scatter(acc, shard)
    scattered.wait()  # the norm reads the reduced shard (NCCL: the lane's stream waits, not the host)
    norm_sq = norm(acc[shard.lo : shard.hi]).square()
    return Reduction(coll.all_reduce(norm_sq), shard.lo, shard.hi, norm_sq)
