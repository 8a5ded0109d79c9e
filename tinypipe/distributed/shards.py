"""Sharding arithmetic: each layer's flat trainable buffer split into R contiguous shards of
``ceil(n / R)`` elements (the last one shorter; padded to R equal pieces for reduce-scatter and
all-gather, which want equal sizes)."""

from __future__ import annotations

from dataclasses import dataclass


def shard_numel(n: int, replicas: int) -> int:
    """Elements per shard of a buffer of ``n`` (the padded piece size)."""
    return -(-n // replicas) if n else 0


def padded_numel(n: int, replicas: int) -> int:
    """``n`` rounded up to R equal shards: the room a reduce-scatter reads."""
    return shard_numel(n, replicas) * replicas


@dataclass(frozen=True)
class Shard:
    """Rank ``rank``'s part ``[lo, hi)`` of a buffer of ``n`` elements (may be empty)."""

    n: int
    replicas: int
    rank: int

    @property
    def size(self) -> int:
        """The padded piece size (every rank's piece is this long in a collective)."""
        return shard_numel(self.n, self.replicas)

    @property
    def lo(self) -> int:
        return min(self.n, self.rank * self.size)

    @property
    def hi(self) -> int:
        return min(self.n, (self.rank + 1) * self.size)

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def of(self, rank: int) -> Shard:
        return Shard(self.n, self.replicas, rank)
