"""The optimizer path of one rank of sharded data-parallel replicas (``Plan.optimizer_sharding ==
"shard"``): each rank keeps every fp32 master weight (it uploads them) but AdamW moments, the
retained gradient and the optimizer step only for its 1/R shard of each layer, so host memory is
about 4 + 8/R bytes per parameter (+ 4/R with clipping).

Per layer: the gradient is reduce-scattered on the device (:mod:`tinypipe.distributed.reduce`),
only this rank's shard is downloaded and stepped -- by the unchanged :class:`OptimizerPath`, which
sees a :class:`ShardView` of the store whose layers *are* the shards -- and the updated master
slices are all-gathered on the background lane, in the next step's upload order, after the
layer's leftover (clipped) work: each upload waits only for its own layer, so the gathers overlap
the next forward. The decisions are identical on every rank because every number they read is:
each layer's norm is the all-reduced sum of the shards' squared norms, and the loss is all-reduced.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from tinypipe.distributed.group import Replicas
from tinypipe.distributed.shards import Shard
from tinypipe.memory.host_store import HostStore, LayerState, SliceState
from tinypipe.runtime.optim.decisions import StepDecisions
from tinypipe.runtime.optim.path import OptimizerPath


class ShardView:
    """The host store as one rank's optimizer sees it: each sharded layer's state is its shard
    (a view of the master, shard-sized moments); unsharded layers (frozen ones, layers stepped on
    their device) are the store's own. Replaces the store's full-size moments -- never touched
    before a first step, so never resident -- with shard-sized ones."""

    def __init__(self, store: HostStore, replicas: Replicas, unsharded: frozenset[int]) -> None:
        self.full = store
        self.shards: dict[int, Shard] = {}
        self.layers: list[LayerState] = []
        for i, s in enumerate(store.layers):
            n = s.spec.train_numel
            if n == 0 or i in unsharded:
                self.layers.append(s)
                continue
            sh = replicas.shard(n)
            s.exp_avg = torch.empty(sh.numel, dtype=torch.float32)
            s.exp_avg_sq = torch.empty(sh.numel, dtype=torch.float32)
            self.layers.append(SliceState(spec=dataclasses.replace(s.spec, train_numel=sh.numel),
                                          master=s.master[sh.lo : sh.hi], exp_avg=s.exp_avg,
                                          exp_avg_sq=s.exp_avg_sq, step=s.step, base=sh.lo))
            self.shards[i] = sh

    def offloaded(self, layer: int, name: str) -> bool:
        return False  # sharding and the SSD tier are not combined (refused at build)

    def sync_steps(self, to_full: bool) -> None:
        """Copy the per-layer step counts shard -> store (``to_full``) or store -> shard."""
        for i in self.shards:
            if to_full:
                self.full.layers[i].step = self.layers[i].step
            else:
                self.layers[i].step = self.full.layers[i].step


class ShardedOptimizerPath(OptimizerPath):
    """:class:`OptimizerPath` over a :class:`ShardView`, plus the all-gathers of the masters."""

    def __init__(self, view: ShardView, replicas: Replicas, **kwargs: object) -> None:
        super().__init__(view, **kwargs)  # type: ignore[arg-type]
        self.view = view
        self.replicas = replicas
        R = replicas.size
        longest = max((sh.size for sh in view.shards.values()), default=0)
        self._out = torch.empty(longest * R, dtype=torch.float32)  # one layer's gathered pieces
        self._mine = torch.zeros(longest, dtype=torch.float32)  # this rank's piece, padded

    def shard(self, layer: int) -> Shard | None:
        return self.view.shards.get(layer)

    def leftover(self, work: list[tuple[int, Callable[[], None]]],
                 dec: StepDecisions) -> list[tuple[int, Callable[[], None]]]:
        """Every sharded layer's leftover work followed by its all-gather, in upload order (the
        same list on every rank: the decisions are). Gathered even after a skipped step, so the
        ranks' masters never drift apart by an undo's rounding."""
        self.view.sync_steps(to_full=True)
        own: dict[int, list[Callable[[], None]]] = {}
        for layer, fn in work:
            own.setdefault(layer, []).append(fn)
        rank = dec.upload_order
        order = sorted(set(self.view.shards) | set(own), key=lambda layer: rank.get(layer, layer))
        return [(layer, _then(own.get(layer, []), self._gather, layer)) for layer in order]

    def _gather(self, layer: int) -> None:
        sh = self.view.shards.get(layer)
        if sh is None:
            return
        full = self.view.full.layers[layer].master
        mine = self._mine[: sh.size]
        mine[: sh.numel].copy_(full[sh.lo : sh.hi])
        out = self._out[: sh.size * self.replicas.size]
        self.replicas.gather.all_gather(out, mine).wait()
        full.copy_(out[: sh.n])

    def gather_all(self) -> None:
        """All-gather every sharded layer now (after a checkpoint's shards were loaded)."""
        for layer in sorted(self.view.shards):
            self._gather(layer)


def _then(fns: list[Callable[[], None]], gather: Callable[[int], None], layer: int) -> Callable[[], None]:
    def run() -> None:
        for fn in fns:
            fn()
        gather(layer)
    return run
