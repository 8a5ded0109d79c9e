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
  previous pack's forward is done.

:func:`race_forward_end` returns when the forward ends. It is a plain simulation over the layers
(the search evaluates thousands of plans: a few dozen events each).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class RaceUpload:
    """One layer of the next step's upload order: the device it goes to, its pack (None: the
    embedding or the head, which have their own buffers), the trainable elements the host pass
    steps before it may go up (0: stepped on the device) and its upload bytes (0: not uploaded).
    ``gates_forward``: every pack's forward waits for it (the embedding)."""

    device: int
    pack: int | None
    host_numel: int
    up_bytes: int
    gates_forward: bool = False


@dataclass(frozen=True, slots=True)
class RaceResult:
    """When the forward ends, when the host pass ends, and when the last upload (the head's
    included) has landed; seconds from the start of the step."""

    forward_end_s: float
    host_pass_s: float
    uploads_end_s: float


def race_forward_end(uploads: Sequence[RaceUpload], pack_forward_s: Sequence[float], *, slots: int,
                     devices: int, h2d: float, adamw_rate: float) -> RaceResult:
    """Simulate the race (module docstring). ``uploads`` in upload order, ``pack_forward_s[q]`` the
    forward compute of pack ``q`` (all its micro-batches), ``h2d`` bytes/s per device link,
    ``adamw_rate`` parameters/s of the host pass. Packs with no uploads in ``uploads`` are resident:
    ready at the start.

    A device's slots are reused first-released-first (the builder's ring) and packs release theirs
    in order, so each ring is a FIFO of release times."""
    num_packs = len(pack_forward_s)
    remaining = [0] * num_packs
    for u in uploads:
        if u.pack is not None:
            remaining[u.pack] += 1
    ring = [deque([0.0] * slots) for _ in range(devices)]  # per device: release times, earliest first
    link = [0.0] * devices
    ready = [0.0] * num_packs
    held: list[list[int]] = [[] for _ in range(num_packs)]  # devices of each pack's slots
    host = first_ready = last_up = forward = 0.0
    done = 0  # packs whose forward is computed, in order
    for u in uploads:
        host += u.host_numel / adamw_rate
        if u.pack is None and not u.up_bytes:
            continue
        dev = u.device
        start = host if host > link[dev] else link[dev]
        if u.pack is not None:
            while done < num_packs and remaining[done] == 0:  # earlier forwards free the slots needed
                forward = max(forward, ready[done], first_ready) + pack_forward_s[done]
                for d in held[done]:
                    ring[d].append(forward)
                done += 1
            free = ring[dev].popleft()
            if free > start:
                start = free
        end = link[dev] = start + u.up_bytes / h2d
        if end > last_up:
            last_up = end
        if u.pack is None:
            if u.gates_forward and end > first_ready:
                first_ready = end
            continue
        held[u.pack].append(dev)
        if end > ready[u.pack]:
            ready[u.pack] = end
        remaining[u.pack] -= 1
    while done < num_packs:
        forward = max(forward, ready[done], first_ready) + pack_forward_s[done]
        done += 1
    return RaceResult(forward_end_s=forward, host_pass_s=host, uploads_end_s=last_up)
