"""Task kinds, task ids and lane names: built and parsed here only.

A task id is the compact string the schedule, the validator's messages, the Chrome trace and the
timeline show (``fwd/3/1``: pack 3's forward of micro-batch 1); :class:`TaskId` is the same name
as data. A lane name says which device stream or host worker runs a lane (``dev0:h2d``,
``host:optimizer``); :class:`Lane` is its parsed form. The strings are dictionary keys on the
step's hot path, so the builders below are plain f-strings and parsing happens once per lane.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Literal


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

EMBED_FWD_ID = "efwd"
EMBED_BWD_ID = "ebwd"


def resident_upload_id(layer: int) -> str:
    """``ru/E`` (layer 0), ``ru/H`` (:data:`HEAD`) or ``ru/L<layer>`` (a resident pack's block)."""
    return "ru/E" if layer == 0 else "ru/H" if layer == HEAD else f"ru/L{layer}"


def upload_id(phase: Phase, pack: int, layer: int) -> str:
    return f"up/{phase}{pack}/L{layer}"


def fwd_id(pack: int, mb: int) -> str:
    return f"fwd/{pack}/{mb}"


def bwd_id(pack: int, mb: int) -> str:
    return f"bwd/{pack}/{mb}"


def head_id(mb: int) -> str:
    return f"head/{mb}"


def reduce_id(layer: int) -> str:
    return f"red/L{layer}"


def download_id(layer: int) -> str:
    return f"dl/L{layer}"


def update_id(layer: int) -> str:
    return f"upd/L{layer}"


_PATTERNS: tuple[tuple[Kind, re.Pattern[str]], ...] = (
    (Kind.RESIDENT_UPLOAD, re.compile(r"ru/(?:(?P<embed>E)|(?P<head>H)|L(?P<layer>\d+))")),
    (Kind.UPLOAD, re.compile(r"up/(?P<phase>[fb])(?P<pack>\d+)/L(?P<layer>\d+)")),
    (Kind.EMBED_FWD, re.compile(EMBED_FWD_ID)),
    (Kind.FWD, re.compile(r"fwd/(?P<pack>\d+)/(?P<mb>\d+)")),
    (Kind.HEAD, re.compile(r"head/(?P<mb>\d+)")),
    (Kind.BWD, re.compile(r"bwd/(?P<pack>\d+)/(?P<mb>\d+)")),
    (Kind.EMBED_BWD, re.compile(EMBED_BWD_ID)),
    (Kind.REDUCE, re.compile(r"red/L(?P<layer>\d+)")),
    (Kind.DOWNLOAD, re.compile(r"dl/L(?P<layer>\d+)")),
    (Kind.UPDATE, re.compile(r"upd/L(?P<layer>\d+)")),
)


@dataclass(frozen=True)
class TaskId:
    """A task's name as data; ``str()`` gives the id the schedule uses. Unused fields are None."""

    kind: Kind
    pack: int | None = None
    mb: int | None = None
    layer: int | None = None  # uploads, downloads, updates (:data:`HEAD` for ``ru/H``)
    phase: Phase | None = None  # uploads

    def __str__(self) -> str:
        k = self.kind
        if k is Kind.RESIDENT_UPLOAD:
            return resident_upload_id(_need(self.layer))
        if k is Kind.UPLOAD:
            return upload_id(self.phase or "f", _need(self.pack), _need(self.layer))
        if k is Kind.EMBED_FWD:
            return EMBED_FWD_ID
        if k is Kind.FWD:
            return fwd_id(_need(self.pack), _need(self.mb))
        if k is Kind.HEAD:
            return head_id(_need(self.mb))
        if k is Kind.BWD:
            return bwd_id(_need(self.pack), _need(self.mb))
        if k is Kind.EMBED_BWD:
            return EMBED_BWD_ID
        if k is Kind.REDUCE:
            return reduce_id(_need(self.layer))
        if k is Kind.DOWNLOAD:
            return download_id(_need(self.layer))
        return update_id(_need(self.layer))

    @classmethod
    def parse(cls, text: str) -> TaskId:
        """The inverse of ``str()``; ValueError for a string no builder here makes."""
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


def _need(value: int | None) -> int:
    if value is None:
        raise ValueError("task id field missing for its kind")
    return value


def _int(text: str | None) -> int | None:
    return None if text is None else int(text)


@dataclass(frozen=True)
class Lane:
    """A lane: a device stream (``device`` set, ``name`` the stream) or a host worker (``device``
    None). ``str()`` is the name traces and timelines show."""

    device: int | None
    name: str

    def __str__(self) -> str:
        return f"host:{self.name}" if self.device is None else f"dev{self.device}:{self.name}"

    @classmethod
    def parse(cls, text: str) -> Lane:
        where, sep, name = text.partition(":")
        if sep and name and where == "host":
            return cls(None, name)
        if sep and name and where.startswith("dev") and where[3:].isdigit():
            return cls(int(where[3:]), name)
        raise ValueError(f"not a lane name: {text!r}")


OPTIMIZER_LANE = Lane(None, "optimizer")  # the host AdamW as gradients arrive
BACKGROUND_LANE = Lane(None, "deferred-optimizer")  # a clipped step's leftover AdamW (next step)


def lane_of(kind: Kind, device: int) -> str:
    """The lane that runs tasks of ``kind`` on ``device``."""
    if kind is Kind.UPDATE:
        return str(OPTIMIZER_LANE)
    if kind in (Kind.UPLOAD, Kind.RESIDENT_UPLOAD):
        return str(Lane(device, "h2d"))
    if kind is Kind.DOWNLOAD:
        return str(Lane(device, "d2h"))
    if kind is Kind.REDUCE:  # replicas' gradient collectives: their own lane, ordered after the backward
        return str(Lane(device, "collective"))
    return str(Lane(device, "compute"))
