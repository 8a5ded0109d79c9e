"""Task kinds, task ids and lanes: built here as data, read back from text only at the edges.

A :class:`TaskId` is a task's name as data; ``str()`` gives the compact text the schedule dump,
the validator's messages, the Chrome trace and the timeline show (``fwd/3/1``: pack 3's forward of
micro-batch 1). A :class:`Lane` says which device stream or host worker runs a lane; ``str()``
gives ``dev0:h2d`` / ``host:optimizer``. Both are NamedTuples: the schedule, the step's signals and
its lanes are keyed by them on the step's hot path, and a tuple is hashed and compared in C (a
dataclass's ``__hash__`` / ``__eq__`` would run Python code at every lookup).
:meth:`TaskId.parse` and :meth:`Lane.parse` read the text back (traces, tests, tools); nothing
on the step's path calls them.
"""

from __future__ import annotations

import enum
import re
from typing import Literal, NamedTuple


class Kind(str, enum.Enum):
    RESIDENT_UPLOAD = "resident_upload"  # embedding / head / resident packs into their own buffers
    UPLOAD = "upload"  # a block layer into a layer slot
    EMBED_FWD = "embed_fwd"  # whole global batch: token ids -> hidden states + block arguments
    FWD = "fwd"  # one pack x one forward micro-batch, no autograd graph
    HEAD = "head"  # final norm + lm_head + loss, forward and backward fused, one micro-batch
    BWD = "bwd"  # one pack x one backward micro-batch: recompute from the stash, then backward
    EMBED_BWD = "embed_bwd"  # embedding backward over the whole batch
    REDUCE = "reduce"  # data-parallel replicas: a layer's gradient summed across them (async collective)
    DOWNLOAD = "download"  # a layer's accumulated gradients -> host, chunk by chunk
    UPDATE = "update"  # AdamW on the host as the gradient chunks arrive (streams from its DOWNLOAD)


Phase = Literal["f", "b"]  # which pass an upload serves: forward or backward
Stream = Literal["compute", "h2d", "d2h", "collective"]  # the device streams that are lanes

#: ``TaskId.layer`` of the head's resident upload (``ru/H``: its index depends on the model)
HEAD = -1


class TaskId(NamedTuple):
    """A task's name as data; ``str()`` gives the id's text. Unused fields are None. Build ids
    with the functions below (one canonical form per text, so equal text means equal ids)."""

    kind: Kind
    pack: int | None = None
    mb: int | None = None
    layer: int | None = None  # uploads, reductions, downloads, updates (:data:`HEAD` for ``ru/H``)
    phase: Phase | None = None  # uploads

    def __str__(self) -> str:
        k = self.kind
        if k is Kind.FWD:
            return f"fwd/{_need(self.pack)}/{_need(self.mb)}"
        if k is Kind.BWD:
            return f"bwd/{_need(self.pack)}/{_need(self.mb)}"
        if k is Kind.UPLOAD:
            return f"up/{self.phase or 'f'}{_need(self.pack)}/L{_need(self.layer)}"
        if k is Kind.RESIDENT_UPLOAD:
            layer = _need(self.layer)
            return "ru/E" if layer == 0 else "ru/H" if layer == HEAD else f"ru/L{layer}"
        if k is Kind.HEAD:
            return f"head/{_need(self.mb)}"
        if k is Kind.EMBED_FWD:
            return "efwd"
        if k is Kind.EMBED_BWD:
            return "ebwd"
        if k is Kind.REDUCE:
            return f"red/L{_need(self.layer)}"
        if k is Kind.DOWNLOAD:
            return f"dl/L{_need(self.layer)}"
        return f"upd/L{_need(self.layer)}"

    def __repr__(self) -> str:
        return f"TaskId.parse({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> TaskId:
        """The inverse of ``str()``, for text read back (traces, tests); ValueError for a string
        no builder here makes."""
        for kind, pattern in _PATTERNS:
            m = pattern.fullmatch(text)
            if m is None:
                continue
            g = m.groupdict()
            layer = 0 if g.get("embed") else HEAD if g.get("head") else _int(g.get("layer"))
            phase = g.get("phase")
            return cls(kind, pack=_int(g.get("pack")), mb=_int(g.get("mb")), layer=layer,
                       phase="f" if phase == "f" else "b" if phase == "b" else None)
        raise ValueError(f"not a task id: {text!r}")


_PATTERNS: tuple[tuple[Kind, re.Pattern[str]], ...] = (
    (Kind.RESIDENT_UPLOAD, re.compile(r"ru/(?:(?P<embed>E)|(?P<head>H)|L(?P<layer>\d+))")),
    (Kind.UPLOAD, re.compile(r"up/(?P<phase>[fb])(?P<pack>\d+)/L(?P<layer>\d+)")),
    (Kind.EMBED_FWD, re.compile(r"efwd")),
    (Kind.FWD, re.compile(r"fwd/(?P<pack>\d+)/(?P<mb>\d+)")),
    (Kind.HEAD, re.compile(r"head/(?P<mb>\d+)")),
    (Kind.BWD, re.compile(r"bwd/(?P<pack>\d+)/(?P<mb>\d+)")),
    (Kind.EMBED_BWD, re.compile(r"ebwd")),
    (Kind.REDUCE, re.compile(r"red/L(?P<layer>\d+)")),
    (Kind.DOWNLOAD, re.compile(r"dl/L(?P<layer>\d+)")),
    (Kind.UPDATE, re.compile(r"upd/L(?P<layer>\d+)")),
)


def _need(value: int | None) -> int:
    if value is None:
        raise ValueError("task id field missing for its kind")
    return value


def _int(text: str | None) -> int | None:
    return None if text is None else int(text)


EMBED_FWD_ID = TaskId(Kind.EMBED_FWD)  # ``efwd``
EMBED_BWD_ID = TaskId(Kind.EMBED_BWD)  # ``ebwd``


def resident_upload_id(layer: int) -> TaskId:
    """``ru/E`` (layer 0), ``ru/H`` (:data:`HEAD`) or ``ru/L<layer>`` (a resident pack's block)."""
    return TaskId(Kind.RESIDENT_UPLOAD, layer=layer)


def upload_id(phase: Phase, pack: int, layer: int) -> TaskId:
    """``up/<phase><pack>/L<layer>``."""
    return TaskId(Kind.UPLOAD, pack=pack, layer=layer, phase=phase)


def fwd_id(pack: int, mb: int) -> TaskId:
    """``fwd/<pack>/<mb>``."""
    return TaskId(Kind.FWD, pack, mb)


def bwd_id(pack: int, mb: int) -> TaskId:
    """``bwd/<pack>/<mb>``."""
    return TaskId(Kind.BWD, pack, mb)


def head_id(mb: int) -> TaskId:
    """``head/<mb>``."""
    return TaskId(Kind.HEAD, mb=mb)


def reduce_id(layer: int) -> TaskId:
    """``red/L<layer>``."""
    return TaskId(Kind.REDUCE, layer=layer)


def download_id(layer: int) -> TaskId:
    """``dl/L<layer>``."""
    return TaskId(Kind.DOWNLOAD, layer=layer)


def update_id(layer: int) -> TaskId:
    """``upd/L<layer>``."""
    return TaskId(Kind.UPDATE, layer=layer)


class Lane(NamedTuple):
    """A lane: a device stream (``device`` set, ``name`` the stream, a :data:`Stream`) or a host
    worker (``device`` None). ``str()`` is the name traces, timelines and thread names show."""

    device: int | None
    name: str

    def __str__(self) -> str:
        return f"host:{self.name}" if self.device is None else f"dev{self.device}:{self.name}"

    def __repr__(self) -> str:
        return f"Lane.parse({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> Lane:
        """The inverse of ``str()``, for text read back (traces, tests, tools); ValueError for
        anything else (the SSD tier's trace lanes ``ssd:read`` / ``ssd:write`` are no lanes of a
        schedule)."""
        where, sep, name = text.partition(":")
        if sep and name and where == "host":
            return cls(None, name)
        if sep and name and where.startswith("dev") and where[3:].isdigit():
            return cls(int(where[3:]), name)
        raise ValueError(f"not a lane name: {text!r}")


OPTIMIZER_LANE = Lane(None, "optimizer")  # the host AdamW as gradients arrive
BACKGROUND_LANE = Lane(None, "deferred-optimizer")  # a clipped step's leftover AdamW (next step)


def compute_lane(device: int) -> Lane:
    """``dev<device>:compute``: where the device's forward, head and backward tasks run."""
    return Lane(device, "compute")


def lane_of(kind: Kind, device: int) -> Lane:
    """The lane that runs tasks of ``kind`` on ``device``."""
    if kind is Kind.UPDATE:
        return OPTIMIZER_LANE
    if kind in (Kind.UPLOAD, Kind.RESIDENT_UPLOAD):
        return Lane(device, "h2d")
    if kind is Kind.DOWNLOAD:
        return Lane(device, "d2h")
    if kind is Kind.REDUCE:  # replicas' gradient collectives: their own lane, ordered after the backward
        return Lane(device, "collective")
    return compute_lane(device)
