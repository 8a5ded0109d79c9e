"""Layers assisted right after their backward in an unclipped step (``Plan.assisted`` without
clipping): their round trips on the backward's links, the tail layers' round trips, and choosing
them (:func:`choose_backward_assist`; under clipping the choice is :mod:`tinypipe.planner.assist`'s).

An assisted layer is stepped on its device right after its backward: its master and moments go up
(12 B/param) and come back instead of its gradient (12 instead of 4 B/param), and it leaves the
host AdamW lane; a pack-0 / embedding layer trades its tail AdamW for that round trip after the
last backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from tinypipe.memory.device_pool import ASSIST_CHUNK_NUMEL
from tinypipe.planner.work import DOWNLOAD_BYTES, Lanes, OnDevice, Packs, Rates, layer_devices
from tinypipe.schedule.plan import Plan


#: Least share of the step an unclipped step's assisted layers must save for the planner to choose
#: them. 5 %: assists the model priced 3-4 % faster measured no gain, and assisting a turn's layers
#: measured slower (their H2D shares the link with the next packs' uploads) (docs/measured.md).
UNCLIPPED_ASSIST_MIN_GAIN = 0.05
#: Host seconds per assisted chunk (``ASSIST_CHUNK_NUMEL`` elements) an unclipped step adds to its
#: backward: about eight launches on the d2h lane's thread, which holds the GIL the compute lanes'
#: launches need. Not measured: an estimate at ~4 us a launch. It also makes a plan that needs no
#: assist win over one that ties with it only by it.
ASSIST_CHUNK_HOST_S = 3e-5
#: Bytes per parameter an assisted layer moves right after its backward (no clipping: the download
#: task steps it, runtime/optim/assist.py): master and moments up, and down instead of the fp32 gradient.
BACKWARD_ASSIST_UP_BYTES = 12
BACKWARD_ASSIST_DOWN_BYTES = 12


def _tail_layers(plan: Plan) -> frozenset[int]:
    """The layers whose host AdamW trails the last backward: the embedding and the lowest
    host-stepped pack's (their gradients are the step's last)."""
    R = plan.resident_packs
    return frozenset({0} | ({b + 1 for b in plan.packs[R]} if R < plan.num_packs else set()))


@dataclass(frozen=True)
class BackwardAssist:
    """Where an unclipped step's assisted layers land: per layer its backward device, trainable
    elements and whether its update trails the backward (pack 0 / the embedding: the tail)."""

    device: dict[int, int]
    train: dict[int, int]
    tail: frozenset[int]

    @staticmethod
    def of(packs: Packs, dev: OnDevice) -> BackwardAssist:
        plan, trains = packs.plan, packs.sizes.layer_train_numels
        where = layer_devices(plan, plan.bwd_device)
        return BackwardAssist(where, {layer: trains[layer] for layer in where}, _tail_layers(plan))

    def apply(self, lanes: Lanes, layers: tuple[int, ...], rates: Rates,
              prefixes: dict[tuple[int, ...], AssistSums] | None = None) -> tuple[Lanes, float, float]:
        """The lanes with ``layers``' round trips on the links, the tail layers' round trips
        (they trail the last backward, as their host steps would) in seconds, and the host
        seconds their chunks' launches add to the backward. ``prefixes``: the sums of earlier
        calls on the same ``lanes``, by layers; the search adds one layer at a time, so a call
        extends its prefix's sums (the same additions in the same order: the same floats)."""
        start = prefixes.get(layers[:-1]) if prefixes is not None else None
        todo = layers[-1:] if start is not None else layers
        b_up, down, tail_link, chunks = start or AssistSums(lanes.b_up, lanes.down, 0.0, 0)
        b_up, down = list(b_up), list(down)
        for layer in todo:
            d, t = self.device[layer], self.train[layer]
            chunks += -(-t // ASSIST_CHUNK_NUMEL)
            if layer in self.tail:
                trip = max(BACKWARD_ASSIST_UP_BYTES / rates.h2d, BACKWARD_ASSIST_DOWN_BYTES / rates.d2h)
                tail_link += t * trip
                continue
            b_up[d] += t * BACKWARD_ASSIST_UP_BYTES
            down[d] += t * (BACKWARD_ASSIST_DOWN_BYTES - DOWNLOAD_BYTES)
        if prefixes is not None:
            prefixes[layers] = AssistSums(b_up, down, tail_link, chunks)
        return lanes.with_backward_links(b_up, down), tail_link, chunks * ASSIST_CHUNK_HOST_S


class AssistSums(NamedTuple):
    """:meth:`BackwardAssist.apply`'s running sums: per device the backward's upload and download
    bytes, the tail layers' round-trip seconds, the chunks launched."""

    b_up: list[float]
    down: list[float]
    tail_link: float
    chunks: int


def choose_backward_assist(bwd: BackwardAssist, allowed: frozenset[int], base: float,
                            cost: Callable[[tuple[int, ...]], float]) -> tuple[int, ...]:
    """The layers to assist right after their backward: in backward order while each makes the
    backward + tail (``cost``; ``base`` with none) shorter -- they all move the same terms, so the
    first that does not help ends them (the search prices thousands of plans) -- then each tail
    layer (pack 0, the embedding: its round trip is exposed) that still helps."""
    layers: tuple[int, ...] = ()
    best = base
    for layer in sorted(bwd.device, reverse=True):
        # less than a chunk (a tied head's final norm): its round trip costs more than it saves
        if layer not in allowed or bwd.train[layer] < ASSIST_CHUNK_NUMEL or layer in bwd.tail:
            continue
        t = cost(layers + (layer,))
        if t >= best - 1e-6:
            break
        layers, best = layers + (layer,), t
    for layer in sorted(bwd.tail):
        if layer in allowed and bwd.train[layer] >= ASSIST_CHUNK_NUMEL:
            t = cost(layers + (layer,))
            if t < best - 1e-6:
                layers, best = layers + (layer,), t
    return layers
