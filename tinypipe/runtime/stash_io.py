"""Host-stashed activations: device-to-host writes and prefetched host-to-device reads on side
streams, so the compute stream never waits for a stash transfer it does not need yet."""

from __future__ import annotations

import torch

from tinypipe.runtime.buffers import RowBuffer
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.schedule.tasks import Kind, Task


class StashIO:
    """Row reads/writes of boundary buffers for :class:`~tinypipe.runtime.step.StepRunner`."""

    def _write_rows(self, buf: RowBuffer, lo: int, hi: int, src: torch.Tensor, dev: DeviceRuntime) -> None:
        """Write rows; a device-to-host stash copy goes on a side stream so compute never waits."""
        if buf.owner is None and dev.backend.is_cuda:
            side = dev.streams["stash_out"]
            dev.backend.wait_event(side, dev.backend.record_event(dev.streams["compute"]))
            with dev.backend.use_stream(side):
                buf.tensor[lo:hi].copy_(src, non_blocking=True)  # type: ignore[index]
            src.record_stream(side)  # type: ignore[arg-type]
            self._extra[f"dev{dev.index}:compute"].append(side)
        else:
            buf.write(lo, hi, src)

    def _read_rows(self, buf: RowBuffer, lo: int, hi: int, dev: DeviceRuntime) -> torch.Tensor:
        """Rows on ``dev``: prefetched copy, a view, or a fresh copy."""
        hit = self._prefetched.pop((id(buf), lo, hi, dev.index), None)
        if hit is not None:
            tensor, event = hit
            dev.backend.wait_event(dev.streams["compute"], event)
            return tensor
        return buf.read(lo, hi, dev.device)

    def _prefetch_rows(self, buf: RowBuffer, lo: int, hi: int, dev: DeviceRuntime, producers: list[str]) -> None:
        """Start copying host-stashed rows to ``dev`` on a side stream, if their producers are done."""
        if buf.owner is not None or not dev.backend.is_cuda or buf.tensor is None:
            return
        if not all(self.signals[p].is_set for p in producers):
            return
        key = (id(buf), lo, hi, dev.index)
        if key in self._prefetched:
            return
        side = dev.streams["stash_in"]
        for p in producers:
            for event in self.signals[p].events:
                dev.backend.wait_event(side, event)
        out = self._ring_buffer(dev, buf.tensor[lo:hi].shape, buf.dtype)
        with dev.backend.use_stream(side):
            out.copy_(buf.tensor[lo:hi], non_blocking=True)
        self._prefetched[key] = (out, dev.backend.record_event(side))

    def _ring_buffer(self, dev: DeviceRuntime, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """One of two preallocated prefetch buffers per device, used alternately.

        Fixed buffers keep the side stream away from the caching allocator (no cudaMalloc, no
        reuse of blocks the compute stream may still read). Buffer k is reused two prefetches
        later; the side stream first waits for the compute stream's work queued so far, which
        includes the task that consumed it.
        """
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

    def _prefetch_next(self, task: Task, dev: DeviceRuntime) -> None:
        """Prefetch the host-stashed input rows of this pack's next micro-batch."""
        q = task.pack
        if task.kind is Kind.FWD:
            rows = self.s.fwd_rows()
            if task.mb + 1 >= len(rows) or q == 0:
                return
            lo, hi = rows[task.mb + 1]
            self._prefetch_rows(self.state.acts[q], lo, hi, dev, [f"fwd/{q - 1}/{task.mb + 1}"])
        elif task.kind is Kind.BWD:
            rows = self.s.bwd_rows()
            if task.mb + 1 >= len(rows) or q == 0:
                return
            lo, hi = rows[task.mb + 1]
            frows = self.s.fwd_rows()
            prods = [f"fwd/{q - 1}/{m}" for m, (a, b) in enumerate(frows) if a < hi and b > lo]
            self._prefetch_rows(self.state.acts[q], lo, hi, dev, prods)
