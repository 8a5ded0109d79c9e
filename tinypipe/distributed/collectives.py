"""Collectives over one process group, for CPU tensors with gloo and device tensors with NCCL.

Every call issues asynchronously and returns a :class:`Pending` handle; ``wait()`` on it blocks
the host with gloo and, with NCCL, orders the *current* stream after the collective (the caller's
stream then runs on without the host waiting). Ops on one group must be issued in the same order
on every rank, so each issuing thread gets its own group (:mod:`tinypipe.distributed.group`).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from tinypipe.distributed.shards import Shard


class Pending:
    """Async work handles of one logical collective (several ops, waited in order)."""

    def __init__(self, works: list[object] | None = None) -> None:
        self.works = list(works or [])

    def add(self, work: object | None) -> None:
        if work is not None:
            self.works.append(work)

    def wait(self) -> None:
        for w in self.works:
            w.wait()  # type: ignore[attr-defined]
        self.works = []


class Collectives:
    """One process group's collectives; ``backend`` is the group's ("gloo" or "nccl")."""

    def __init__(self, group: object, rank: int, world_size: int, backend: str,
                 timeout: datetime.timedelta | None = None) -> None:
        self.group = group
        self.rank, self.world_size = rank, world_size
        self.backend = backend
        self.timeout = timeout

    def all_reduce(self, t: torch.Tensor) -> Pending:
        """Sum ``t`` in place over the ranks (results identical on every rank)."""
        return Pending([dist.all_reduce(t, group=self.group, async_op=True)])

    def reduce_scatter(self, flat: torch.Tensor, shard: Shard) -> Pending:
        """Sum ``flat`` (at least ``shard.size * R`` elements of room, ``shard.n`` real ones) so that
        this rank's ``[shard.lo, shard.hi)`` holds the total.

        NCCL: an in-place reduce-scatter (this rank's output is its piece of the input) over the
        padded buffer; the padding's values are never read. gloo on CPU: an all-reduce of the real
        elements (same sums; twice the traffic -- gloo's reduce-scatter is not in place)."""
        if self.backend != "nccl":
            return self.all_reduce(flat[: shard.n])
        size = shard.size
        full = flat[: size * self.world_size]
        out = full[self.rank * size : (self.rank + 1) * size]
        return Pending([dist.reduce_scatter_tensor(out, full, group=self.group, async_op=True)])

    def all_gather(self, out: torch.Tensor, mine: torch.Tensor) -> Pending:
        """``out`` (R equal pieces) gets every rank's ``mine`` in rank order.

        NCCL: one all-gather into the flat buffer. gloo: the list form into ``out``'s R contiguous
        views (the flat-buffer call is not in every torch's gloo)."""
        if self.backend == "nccl":
            return Pending([dist.all_gather_into_tensor(out, mine, group=self.group, async_op=True)])
        pieces = list(out.view(self.world_size, -1).unbind(0))
        return Pending([dist.all_gather(pieces, mine, group=self.group, async_op=True)])

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's picklable ``obj`` (blocking; start-up only)."""
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        """Block until every rank got here (a zero-byte all-reduce: gloo's barrier has no timeout
        of its own on some versions)."""
        t = torch.zeros(1)
        dist.all_reduce(t, group=self.group)

    def sum_scalar(self, value: float, dtype: torch.dtype = torch.float64) -> float:
        """The sum of ``value`` over the ranks (blocking; identical on every rank)."""
        t = torch.tensor([value], dtype=dtype)
        dist.all_reduce(t, group=self.group)
        return float(t.item()) if dtype.is_floating_point else int(t.item())

    def any_flag(self, flag: bool) -> bool:
        """Whether any rank passed True (blocking): one decision for every rank."""
        return self.sum_scalar(1.0 if flag else 0.0) > 0
