"""Kept graphs waiting in host memory: a kept pack's saved activations, offloaded.

A kept pack (``Plan.keep_activations``) skips its recompute but holds its forward's saved tensors
for the whole step: on the GPU that is ~2 GB per 3B-shape block at 16 x 2048 tokens even in the
compact form (models/compact.py), so 24 GiB keeps a handful of blocks. ``Plan.kept_on_host``
moves a kept pack's saved activations to host memory as its forward makes them -- over the
device-to-host direction of the link, which the forward otherwise leaves mostly idle -- and back
before its backward, over the host-to-device direction beside the weight uploads:

* each saved tensor on the device (a :class:`~tinypipe.runtime.weight_refs.WeightRefs` sink: the
  weights are references anyway) is copied into a page-locked host buffer on the ``kept_out``
  side stream once the compute stream has produced it; the device copy is released when the copy
  is done;
* a host-kept forward waits (its lane, not the GPU) until the copies of the graph two forward
  micro-batches back are done: the device holds at most two graphs on their way down, however
  far the link falls behind (the estimator counts two);
* one backward task ahead (the compute lane's order, :func:`prefetch_order`), the graph's tensors
  are copied back on the ``kept_in`` side stream into fresh device tensors; the backward waits
  for that copy only, and frees them with the graph.

The host buffers are reused step after step (the same shapes each step), so a step pins nothing.
Only tensors that go through autograd's saved-tensor hooks move: full graphs and compiled compact
ones (an eager compact graph keeps its cache outside the hooks, so a host-kept pack runs eager
graphs in full, runtime/compute_handlers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.rng import replay_pieces
from tinypipe.schedule.ids import Kind, TaskId
from tinypipe.schedule.tasks import Schedule


class HostKeptBuffers:
    """Host tensors kept saved activations wait in, by (pack, forward micro-batch, index): reused
    while the shapes stay the same (every step of one batch shape), page-locked on CUDA."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[int, int, int], torch.Tensor] = {}

    def get(self, key: tuple[int, int, int], like: torch.Tensor, pin: bool) -> torch.Tensor:
        t = self._bufs.get(key)
        if t is None or t.shape != like.shape or t.stride() != like.stride() or t.dtype != like.dtype:
            t = torch.empty_strided(like.size(), like.stride(), dtype=like.dtype, pin_memory=pin)
            self._bufs[key] = t
        return t

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._bufs.values())


@dataclass
class _Offloaded:
    """One saved tensor in host memory, and (once prefetched) its device copy."""

    host: torch.Tensor
    device: torch.Tensor | None = None


@dataclass
class HostKeptGraph:
    """The saved activations of one kept forward micro-batch, offloaded (see the module doc)."""

    buffers: HostKeptBuffers
    pack: int
    mb: int
    dev: DeviceRuntime
    items: list[_Offloaded] = field(default_factory=list)
    _down: object | None = None  # the side stream's event after the last offload copy
    _up: object | None = None  # ... after the prefetch copies
    _prefetched: bool = False

    def offload(self, t: torch.Tensor) -> torch.Tensor | _Offloaded:
        """A saved tensor's pack hook: its host copy's handle (a view of part of a storage stays as
        it is: copying it would not free the storage)."""
        whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
        if t.numel() == 0 or t.storage_offset() or not whole or t.device != self.dev.device:
            return t
        dev = self.dev
        cuda = dev.backend.is_cuda
        host = self.buffers.get((self.pack, self.mb, len(self.items)), t, pin=cuda)
        if cuda:
            side = dev.streams["kept_out"]
            dev.backend.wait_event(side, dev.backend.record_event(dev.streams["compute"]))
            with dev.backend.use_stream(side):
                host.copy_(t, non_blocking=True)
            t.record_stream(side)  # type: ignore[arg-type]
            self._down = dev.backend.record_event(side)
        else:
            host.copy_(t)
        item = _Offloaded(host)
        self.items.append(item)
        return item

    def wait_down(self) -> None:
        """Block the calling lane until this graph's copies to the host are done."""
        self.dev.backend.sync_event(self._down)

    def prefetch(self) -> None:
        """Start copying the saved activations back to the device (once)."""
        if self._prefetched:
            return
        self._prefetched = True
        dev = self.dev
        side = dev.streams["kept_in"]
        dev.backend.wait_event(side, self._down)
        with dev.backend.use_stream(side):
            for item in self.items:
                h = item.host
                item.device = torch.empty_strided(h.size(), h.stride(), dtype=h.dtype, device=dev.device)
                item.device.copy_(h, non_blocking=True)
        self._up = dev.backend.record_event(side)

    def ready(self) -> None:
        """Before the backward differentiates the graph: its tensors on the device, the compute
        stream after their copies (and the allocator told the compute stream uses them)."""
        self.prefetch()
        dev = self.dev
        compute = dev.streams["compute"]
        dev.backend.wait_event(compute, self._up)
        if dev.backend.is_cuda:
            for item in self.items:
                item.device.record_stream(compute)  # type: ignore[union-attr, arg-type]

    def restore(self, saved: object) -> torch.Tensor:
        """A saved tensor's unpack hook."""
        assert isinstance(saved, _Offloaded) and saved.device is not None, "host-kept graph not ready"
        return saved.device


def prefetch_order(sched: Schedule) -> dict[TaskId, list[tuple[int, int]]]:
    """Compute task id -> the host-kept graphs (pack, forward micro-batch) of the next backward
    task on its lane: what that task starts copying back once it is done (one task ahead)."""
    plan = sched.plan
    out: dict[TaskId, list[tuple[int, int]]] = {}
    if not plan.kept_on_host:
        return out
    frows = sched.fwd_rows()
    for ids in sched.lanes.values():
        tasks = [sched.tasks[i] for i in ids]
        for i, t in enumerate(tasks):
            if t.kind not in (Kind.HEAD, Kind.BWD):
                continue
            nxt = next((u for u in tasks[i + 1:] if u.kind is Kind.BWD), None)
            if nxt is None or not plan.on_host(nxt.pack):
                continue
            lo, hi = nxt.rows
            out[t.id] = [(nxt.pack, m) for m, _, _ in replay_pieces(frows, lo, hi)]
    return out
