"""When the host AdamW lane is through a step's backward: a queue of layer updates.

An unclipped step steps each host-held layer as soon as its gradient is down. The lane is one
queue: a layer's update starts once its pack's backward is done on the device and its last
gradient chunk has landed, and once the lane has finished the layers before it. After a
micro-batch-wise turn (``Plan.turn_packs``) the turn's layers download only once the whole turn
is through, so they all arrive then.

What the lane has left when the device's backward ends is the step's exposed tail: measured, it is
the lane's backlog, not pack 0's update alone. With the first pack resident on the GPU the lane's
last work arrives one pack earlier, and the tail shrinks (docs/measured.md).

The arrival times follow the device's backward. Each pack's backward seconds are laid end to end
in backward order and scaled to the phase's length, so a link-bound backward stretches them alike.
On N devices the packs' seconds are summed over the devices, which is the order the host sees.
"""

from __future__ import annotations

from itertools import accumulate
from operator import itemgetter
from typing import NamedTuple, Sequence


class Arrival(NamedTuple):
    """One piece of the lane's work: ``numel`` elements whose gradients are all down ``at_s``
    seconds after the backward's start. (A tuple: the search builds millions.)"""

    at_s: float
    numel: int


ARRIVAL_TIME = itemgetter(0)  # an Arrival's sort key


def lane_end_s(arrivals: Sequence[Arrival], rate: float) -> float:
    """Seconds after the backward's start at which the lane, at ``rate`` elements/s, has stepped
    every arrival in arrival order (0 with nothing to step)."""
    end = 0.0
    for at, numel in sorted(arrivals, key=ARRIVAL_TIME):
        if numel > 0:
            end = (at if at > end else end) + numel / rate  # max() without its call: the search's hot loop
    return end


class BackwardOrder(NamedTuple):
    """The packs' end times within the backward, unscaled: what :func:`pack_arrivals` needs of a
    plan that does not change while the search re-prices its backward's length."""

    total_s: float  # the packs' backward seconds, summed
    done_s: list[float]  # position i: the seconds until pack n-1-i (backward order) is done
    turn_s: float  # the turn's packs' seconds
    turn: range

    @staticmethod
    def of(pack_backward_s: Sequence[float], turn: range) -> BackwardOrder:
        return BackwardOrder(sum(pack_backward_s), list(accumulate(reversed(pack_backward_s))),
                             sum(pack_backward_s[q] for q in turn), turn)

    def arrivals(self, host_numel: Sequence[int], backward_s: float, last_chunk_s: float) -> list[Arrival]:
        """See :func:`pack_arrivals`."""
        scale = backward_s / self.total_s if self.total_s > 0 else 0.0
        ats = [done * scale + last_chunk_s for done in self.done_s]
        n = len(ats)
        for q in self.turn:
            ats[n - 1 - q] = self.turn_s * scale + last_chunk_s
        return list(map(Arrival, ats, reversed(host_numel)))


def pack_arrivals(pack_backward_s: Sequence[float], host_numel: Sequence[int], turn: range,
                  backward_s: float, last_chunk_s: float) -> list[Arrival]:
    """Per pack, when its host-stepped elements (``host_numel[q]``; 0 for a resident pack or one
    stepped elsewhere) can start. Packs finish in backward order (the last pack first) at the
    cumulative share of ``pack_backward_s`` scaled to ``backward_s``. The turn's packs all arrive
    when the turn is through. Each waits ``last_chunk_s`` more for its last gradient chunk's
    download."""
    return BackwardOrder.of(pack_backward_s, turn).arrivals(host_numel, backward_s, last_chunk_s)
