"""The forward of a step that follows a clipped step: a race of two pipelines.

When global-norm clipping triggers, no host-stepped layer can be updated before the global norm is
known, so the whole host AdamW pass runs after the backward, on the background lane, while the
next step starts (:mod:`tinypipe.runtime.optim.background`, in the next step's upload order). Each
upload of the next forward waits for its own layer's update, so two pipelines race:

* the **host pass**: layer after layer in upload order, each taking ``train elements / rate``
  (layers stepped on their device -- resident packs, the embedding/head with
  ``device_optimizer`` -- take no host time and are not uploaded);
* the **uploads + forward**: a layer's upload starts once its update is done, the device's link is
  free and a layer slot is free (a pack's slots are released when its forward ends; the ring has
  ``largest pack + prefetch window`` slots); a pack's forward starts once its layers are up and the
  previous pack's forward is done. The uploads are issued in order, so a layer also waits for the
  host updates of every layer before it.

**Assisted layers** (``Plan.assisted``, :mod:`tinypipe.planner.assist`) take no host time: their
upload carries the fp32 master, both moments and the gradient (16 B/param instead of 4), the device
steps them on the h2d stream (``RaceUpload.device_s``) and master and moments go back down on the
d2h lane (``RaceUpload.down_bytes``, 12 B/param) while the next chunks go up. Their transfer takes
the longest of the upload plus the device step, the pair over the link's both-directions rate, and
the download (but the last chunk's download, after the cast into the slot); a later upload waits
for it. The host pass is then shorter for every layer after them, the link busier: the two
pipelines share the work.

Pack inputs stashed on the host move in the forward too (``stash_reads`` / ``stash_writes``: read
up during a pack's forward on its device, its output written down during it): each occupies its
lane from the pack's start, after what the lane already carries -- the link the uploads (and an
assisted layer's download) need.

:func:`race_forward_end` returns when the forward ends; :func:`race_choosing` walks the same race
choosing, layer by layer, between a plain and an assisted upload -- whichever lets the next
upload be done sooner. It is a plain simulation over the layers (the search evaluates thousands of plans: a
few dozen events each).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class RaceUpload:
    """One layer of the next step's upload order: the device it goes to, its pack (None: the
    embedding or the head, which have their own buffers), the trainable elements the host pass
    steps before it may go up (0: stepped on the device, or assisted) and its upload bytes (0: not
    uploaded). ``gates_forward``: every pack's forward waits for it (the embedding). ``layer``: its
    id (as ``Plan.offload``'s). An assisted upload: ``down_bytes`` come back on the d2h lane,
    ``device_s`` of device work run on the upload stream."""

    device: int
    pack: int | None
    host_numel: int
    up_bytes: int
    gates_forward: bool = False
    layer: int = -1
    down_bytes: int = 0
    device_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RaceResult:
    """When the forward ends, when the host pass ends, when the last upload (the head's
    included) has landed and when the d2h lanes drain (assisted downloads, stash writes); seconds
    from the start of the step."""

    forward_end_s: float
    host_pass_s: float
    uploads_end_s: float
    downloads_end_s: float = 0.0


#: (device, bytes) of one pack's forward: its host-stashed input read up, or its output written down.
StashMove = tuple[int, int]
#: A pack's moves of one direction: one, or several on different devices (pack 0's writes at long
#: sequences: the embedding's host-stashed output beside pack 0's own).
StashMoves = StashMove | tuple[StashMove, ...]


class _Race:
    """The race's state; :meth:`add` takes the uploads in order (module docstring)."""

    __slots__ = ("fwd_s", "remaining", "ring", "link", "down", "ready", "held", "host", "first_ready",
                 "last_up", "forward", "done", "h2d", "d2h", "bidir", "rate", "reads", "writes", "lag")

    def __init__(self, uploads: Sequence[RaceUpload], pack_forward_s: Sequence[float], *, slots: int,
                 devices: int, h2d: float, d2h: float | None, bidir: float | None, adamw_rate: float,
                 stash_reads: Sequence[StashMoves | None], stash_writes: Sequence[StashMoves | None],
                 chunk_down_bytes: int) -> None:
        num_packs = len(pack_forward_s)
        self.fwd_s = pack_forward_s
        self.remaining = [0] * num_packs
        for u in uploads:
            if u.pack is not None:
                self.remaining[u.pack] += 1
        # per device: slot release times, earliest first
        self.ring = [deque([0.0] * slots) for _ in range(devices)]
        self.link = [0.0] * devices
        self.down = [0.0] * devices  # each device's d2h lane
        self.ready = [0.0] * num_packs
        self.held: list[list[int]] = [[] for _ in range(num_packs)]  # devices of each pack's slots
        self.host = self.first_ready = self.last_up = self.forward = 0.0
        self.done = 0  # packs whose forward is computed, in order
        self.h2d, self.rate = h2d, adamw_rate
        self.d2h = d2h or h2d
        self.bidir = bidir or (h2d + self.d2h)
        self.reads, self.writes = stash_reads, stash_writes
        self.lag = chunk_down_bytes / self.d2h  # an assisted layer's last chunk comes down after its cast

    def _run_forward(self) -> None:
        """Pack ``done``'s forward (its uploads are all in): its stash moves, its slots' release."""
        q = self.done
        start = max(self.forward, self.ready[q], self.first_ready)
        for moves, lanes, rate in ((self.reads, self.link, self.h2d), (self.writes, self.down, self.d2h)):
            move = moves[q] if q < len(moves) else None
            if move is None:
                continue
            for dev, nbytes in ((move,) if isinstance(move[0], int) else move):
                if nbytes:
                    lanes[dev] = max(lanes[dev], start) + nbytes / rate
        self.forward = start + self.fwd_s[q]
        for d in self.held[q]:
            self.ring[d].append(self.forward)
        self.done += 1

    def _advance(self) -> None:
        """Forwards whose layers are all up: earlier forwards free the slots an upload needs."""
        while self.done < len(self.fwd_s) and self.remaining[self.done] == 0:
            self._run_forward()

    def _timing(self, u: RaceUpload) -> tuple[float, float, float, float]:
        """(host pass after ``u``, its start, when it is done, when its download is) -- no change."""
        host = self.host + u.host_numel / self.rate
        dev = u.device
        start = host if host > self.link[dev] else self.link[dev]
        if u.pack is not None:
            free = self.ring[dev][0]
            if free > start:
                start = free
        end = start + u.up_bytes / self.h2d + u.device_s
        down_end = self.down[dev]
        if u.down_bytes:
            down_end = max(down_end, start) + u.down_bytes / self.d2h
            end = max(end, start + (u.up_bytes + u.down_bytes) / self.bidir,
                      down_end - min(self.lag, u.down_bytes / self.d2h))
        return host, start, end, down_end

    def add(self, u: RaceUpload, timing: tuple[float, float, float, float] | None = None) -> None:
        """Take ``u``, the next upload in order (``timing``: its :meth:`_timing`, if just made)."""
        if timing is None:
            if u.pack is not None:
                self._advance()
            timing = self._timing(u)
        host, _, end, down_end = timing
        self.host = host
        if u.pack is None and not u.up_bytes:
            return
        dev = u.device
        if u.pack is not None:
            self.ring[dev].popleft()
        self.link[dev] = end
        self.down[dev] = down_end
        if end > self.last_up:
            self.last_up = end
        if u.pack is None:
            if u.gates_forward and end > self.first_ready:
                self.first_ready = end
            return
        self.held[u.pack].append(dev)
        if end > self.ready[u.pack]:
            self.ready[u.pack] = end
        self.remaining[u.pack] -= 1

    def add_sooner(self, plain: RaceUpload, other: RaceUpload, next_host_s: float) -> bool:
        """Take ``other`` instead of ``plain`` (the same layer, the same pack) if that lets the next
        upload be done sooner -- the later of its update (``next_host_s`` of host time after this
        one's) and this upload being done -- else ``plain``; returns whether ``other`` was taken."""
        if plain.pack is not None:
            self._advance()
        tp, to = self._timing(plain), self._timing(other)
        take = max(to[0] + next_host_s, to[2]) < max(tp[0] + next_host_s, tp[2])
        self.add(other if take else plain, to if take else tp)
        return take

    def result(self) -> RaceResult:
        while self.done < len(self.fwd_s):
            self._run_forward()
        return RaceResult(forward_end_s=self.forward, host_pass_s=self.host, uploads_end_s=self.last_up,
                          downloads_end_s=max(self.down))


def race_forward_end(uploads: Sequence[RaceUpload], pack_forward_s: Sequence[float], *, slots: int,
                     devices: int, h2d: float, adamw_rate: float, d2h: float | None = None,
                     bidir: float | None = None, stash_reads: Sequence[StashMoves | None] = (),
                     stash_writes: Sequence[StashMoves | None] = (), chunk_down_bytes: int = 0) -> RaceResult:
    """Simulate the race (module docstring). ``uploads`` in upload order, ``pack_forward_s[q]`` the
    forward compute of pack ``q`` (all its micro-batches), ``h2d`` / ``d2h`` / ``bidir`` bytes/s
    per device link (each way, both at once; default: ``h2d`` each way, no shared limit),
    ``adamw_rate`` parameters/s of the host pass; ``stash_reads[q]`` / ``stash_writes[q]``: pack
    ``q``'s host-stash traffic; ``chunk_down_bytes``: an assisted update's download per chunk.
    Packs with no uploads in ``uploads`` are resident: ready at the start.

    A device's slots are reused first-released-first (the builder's ring) and packs release theirs
    in order, so each ring is a FIFO of release times."""
    race = _Race(uploads, pack_forward_s, slots=slots, devices=devices, h2d=h2d, d2h=d2h, bidir=bidir,
                 adamw_rate=adamw_rate, stash_reads=stash_reads, stash_writes=stash_writes,
                 chunk_down_bytes=chunk_down_bytes)
    for u in uploads:
        race.add(u)
    return race.result()


def race_choosing(uploads: Sequence[RaceUpload], assisted: Sequence[RaceUpload | None],
                  pack_forward_s: Sequence[float], *, slots: int, devices: int, h2d: float,
                  adamw_rate: float, d2h: float | None = None, bidir: float | None = None,
                  stash_reads: Sequence[StashMoves | None] = (),
                  stash_writes: Sequence[StashMoves | None] = (),
                  chunk_down_bytes: int = 0) -> tuple[tuple[bool, ...], RaceResult]:
    """The race of :func:`race_forward_end`, choosing at each upload ``i`` with an alternative
    ``assisted[i]`` (None: none) the one after which the next upload can be done sooner (ties:
    the plain one); returns which were taken and the race so walked.

    Greedy, one upload ahead: an assisted upload alone is rarely done sooner than its host update
    plus a plain upload (16 B/param on the link take about what the host takes for the update),
    but while the link carries it the host steps the next layer -- so it is judged by the next
    upload, which keeps host pass and link about level. The caller keeps the choice only if the
    whole step is predicted shorter."""
    race = _Race(uploads, pack_forward_s, slots=slots, devices=devices, h2d=h2d, d2h=d2h, bidir=bidir,
                 adamw_rate=adamw_rate, stash_reads=stash_reads, stash_writes=stash_writes,
                 chunk_down_bytes=chunk_down_bytes)
    taken = []
    for i, (u, alt) in enumerate(zip(uploads, assisted)):
        if alt is None:
            race.add(u)
            taken.append(False)
            continue
        next_host_s = uploads[i + 1].host_numel / adamw_rate if i + 1 < len(uploads) else 0.0
        taken.append(race.add_sooner(u, alt, next_host_s))
    return tuple(taken), race.result()
