"""Host-stashed activations: the host buffers, device-to-host writes and host-to-device reads
that run ahead of the compute stream on side streams, so it never waits for a stash transfer it
does not need yet.

("Read-ahead" here is the stashed rows of the next micro-batch; the plan's ``prefetch_window`` --
layers uploaded ahead of their pack -- is a different thing, realised by the schedule's slots.)
"""

from __future__ import annotations

import torch

from tinypipe.devices.backend import HostPinner
from tinypipe.devices.host_buffers import aligned_empty, registrable
from tinypipe.runtime.buffers import RowBuffer
from tinypipe.runtime.context import StepContext
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.schedule.ids import EMBED_FWD_ID, Kind, TaskId, bwd_id, fwd_id
from tinypipe.runtime.ssd_stash import SsdRows
from tinypipe.schedule.plan import Plan
from tinypipe.schedule.stash_places import host_memory_stashes
from tinypipe.schedule.tasks import Task


class HostStash:
    """Page-locked host buffers for the pack inputs the plan stashes on the host, one per pack
    boundary, kept while the batch shape stays the same."""

    def __init__(self, pinner: HostPinner) -> None:
        self._pinner = pinner
        self._buffers: dict[int, torch.Tensor] = {}

    def prepare(self, plan: Plan, batch: int, seq: int, hidden: int, dtype: torch.dtype,
                long_sequences: bool = False) -> None:
        """Buffers of shape ``[batch, seq, hidden]`` for every host-stashed pack input
        (:func:`~tinypipe.schedule.plan.host_stashed_inputs`: at long sequences the embedding's
        output too) but those on the SSD (``Plan.stash_on_ssd``: :mod:`tinypipe.runtime.ssd_stash`)."""
        shape = (batch, seq, hidden)
        for q, on_host in enumerate(host_memory_stashes(plan, long_sequences)):
            if not on_host:
                continue
            t = self._buffers.get(q)
            if t is None or t.shape != shape:
                flat = aligned_empty(batch * seq * hidden, dtype)
                self._pinner.pin(registrable(flat))
                self._buffers[q] = flat.view(shape)

    def buffer(self, q: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Pack ``q``'s input buffer, as :meth:`prepare` made it for this step."""
        host = self._buffers.get(q)
        if host is None or host.shape != shape or host.dtype != dtype:
            raise RuntimeError(f"host stash for act {q} not prepared")
        return host

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())


class ReadAheadBuffers:
    """Two preallocated device buffers per device that stashed rows are read ahead into, used
    alternately; they outlive the step.

    Fixed buffers keep the side stream away from the caching allocator (no cudaMalloc, no
    reuse of blocks the compute stream may still read). Buffer k is reused two read-aheads
    later; the side stream first waits for the compute stream's work queued so far, which
    includes the task that consumed it.
    """

    def __init__(self) -> None:
        self._ring: dict[int, list] = {}  # device index -> [two buffers, the next one's index]

    def take(self, dev: DeviceRuntime, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        n = int(torch.Size(shape).numel())
        entry = self._ring.get(dev.index)
        if entry is None or entry[0][0].numel() < n or entry[0][0].dtype != dtype:
            bufs = [torch.empty(n, dtype=dtype, device=dev.device) for _ in range(2)]
            entry = self._ring[dev.index] = [bufs, 0]
        bufs, i = entry
        entry[1] = 1 - i
        side = dev.streams["stash_in"]
        dev.backend.wait_event(side, dev.backend.record_event(dev.streams["compute"]))
        return bufs[i][:n].view(shape)


class StashIO:
    """Row reads/writes of one step's pack-boundary buffers, with the stashed rows of the next
    micro-batch read ahead."""

    def __init__(self, ctx: StepContext, buffers: ReadAheadBuffers) -> None:
        self.ctx = ctx
        self.buffers = buffers
        self._ahead: dict[tuple, tuple[torch.Tensor, object]] = {}  # rows in flight to a device

    def write_rows(self, buf: RowBuffer, lo: int, hi: int, src: torch.Tensor, dev: DeviceRuntime) -> None:
        """Write rows; a device-to-host stash copy goes on a side stream so compute never waits."""
        if isinstance(buf, SsdRows):  # through a staging slot to the SSD (runtime/ssd_stash.py)
            buf.write_rows(lo, hi, src, dev, self.ctx.abort.check)
            if dev.backend.is_cuda:
                self._task_uses(dev, dev.streams["stash_out"])
            return
        if buf.owner is None and dev.backend.is_cuda:
            side = dev.streams["stash_out"]
            dev.backend.wait_event(side, dev.backend.record_event(dev.streams["compute"]))
            with dev.backend.use_stream(side):
                buf.tensor[lo:hi].copy_(src, non_blocking=True)  # type: ignore[index]
            src.record_stream(side)  # type: ignore[arg-type]
            self._task_uses(dev, side)
        else:
            buf.write(lo, hi, src)

    def _task_uses(self, dev: DeviceRuntime, side: object) -> None:
        """Record that the running compute task's signal must wait for ``side`` -- once, although
        a task may write several row ranges (the embedding's forward)."""
        sides = self.ctx.side_streams[dev.compute_lane]
        if side not in sides:
            sides.append(side)

    def read_rows(self, buf: RowBuffer, lo: int, hi: int, dev: DeviceRuntime) -> torch.Tensor:
        """Rows on ``dev``: the read-ahead copy, a view, or a fresh copy."""
        if isinstance(buf, SsdRows):  # read back from the SSD (read ahead where it could be)
            return buf.read_rows(lo, hi, dev, dev.device, self.ctx.abort.check)
        hit = self._ahead.pop((id(buf), lo, hi, dev.index), None)
        if hit is not None:
            tensor, event = hit
            dev.backend.wait_event(dev.streams["compute"], event)
            return tensor
        return buf.read(lo, hi, dev.device)

    def _read_ahead(self, buf: RowBuffer, lo: int, hi: int, dev: DeviceRuntime,
                    producers: list[TaskId]) -> None:
        """Start copying host-stashed rows to ``dev`` on a side stream, if their producers are done
        (rows on the SSD: start reading them into a staging slot, on every backend)."""
        if isinstance(buf, SsdRows):
            if all(self.ctx.signals[p].is_set for p in producers):
                buf.prefetch(lo, hi)
            return
        if buf.owner is not None or not dev.backend.is_cuda or buf.tensor is None:
            return
        signals = self.ctx.signals
        if not all(signals[p].is_set for p in producers):
            return
        key = (id(buf), lo, hi, dev.index)
        if key in self._ahead:
            return
        side = dev.streams["stash_in"]
        for p in producers:
            for event in signals[p].events:
                dev.backend.wait_event(side, event)
        out = self.buffers.take(dev, buf.tensor[lo:hi].shape, buf.dtype)
        with dev.backend.use_stream(side):
            out.copy_(buf.tensor[lo:hi], non_blocking=True)
        self._ahead[key] = (out, dev.backend.record_event(side))

    def read_ahead_next(self, task: Task, dev: DeviceRuntime) -> None:
        """Read ahead the host-stashed input rows of this pack's next micro-batch (pack 0's: the
        embedding's output, host-stashed at long sequences, written by the embedding's forward)."""
        q = task.pack
        sched = self.ctx.schedule
        if task.kind is Kind.FWD:
            rows = sched.fwd_rows()
            if task.mb + 1 >= len(rows):
                return
            lo, hi = rows[task.mb + 1]
            self._read_ahead(self.ctx.acts[q], lo, hi, dev, [_producer(q, task.mb + 1)])
        elif task.kind is Kind.BWD:
            rows = sched.bwd_rows()
            if task.mb + 1 >= len(rows):
                return
            lo, hi = rows[task.mb + 1]
            frows = sched.fwd_rows()
            prods = list(dict.fromkeys(_producer(q, m) for m, (a, b) in enumerate(frows)
                                       if a < hi and b > lo))
            self._read_ahead(self.ctx.acts[q], lo, hi, dev, prods)

    def read_ahead_gradient(self, lo: int, hi: int, dev: DeviceRuntime) -> None:
        """Read ahead rows ``lo:hi`` of the embedding's input gradient (boundary 0) when they live
        in host memory: the embedding's backward reads them one forward micro-batch at a time,
        after pack 0's backward wrote them (every one of its tasks is done by then)."""
        prods = [bwd_id(0, m) for m in range(len(self.ctx.schedule.bwd_rows()))]
        self._read_ahead(self.ctx.grads[0], lo, hi, dev, prods)


def _producer(q: int, mb: int) -> TaskId:
    """The task that writes forward micro-batch ``mb``'s rows of pack ``q``'s input: the previous
    pack's forward, or (pack 0) the embedding's forward, which writes the whole batch."""
    return EMBED_FWD_ID if q == 0 else fwd_id(q - 1, mb)
