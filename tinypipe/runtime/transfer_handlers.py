"""The transfer tasks of a step: a layer's upload into its device slot, the replicas' reduction of
its gradient, and its download -- the norm first, then the chunks, to where the optimizer path
routes them (:meth:`~tinypipe.runtime.optim.path.OptimizerPath.download_route`)."""

from __future__ import annotations

import torch

from tinypipe.distributed.reduce import reduce_gradient
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.handler_base import HandlerBase
from tinypipe.runtime.optim.messages import GradChunk, GradEnd, GradNorm
from tinypipe.runtime.upload import upload_destination, upload_layer
from tinypipe.schedule.tasks import Task

NORM_CHUNK = 1 << 24  # elements per partial gradient norm


class TransferHandlers(HandlerBase):
    """Uploads, reductions and downloads of one step."""

    def _upload(self, task: Task, dev: DeviceRuntime) -> None:
        layer = task.layers[0]
        dst = upload_destination(dev, layer, task.slots[0] if task.slots else None)
        upload_layer(self.store, self.optim, dev, layer, dst, self.ctx.abort, task_id=task.id)

    def _reduce(self, task: Task, dev: DeviceRuntime) -> None:
        """Replicas: sum ``layer``'s gradient across them (async; its download waits on it)."""
        layer = task.layers[0]
        rep = self.res.replicas
        assert rep is not None, "a reduce task without replicas"
        acc = dev.pool.grads(layer, task.grad_slots[0] if task.grad_slots else None)
        n = self._spec(layer).train_numel
        if n == 0:  # a frozen layer (LoRA base): nothing to sum, on every rank alike
            return
        shard = self.optim.shard(layer)
        self.ctx.reductions[layer] = reduce_gradient(rep.grads[dev.index], acc, n, shard, _chunked_norm)

    def _download(self, task: Task, dev: DeviceRuntime) -> None:
        layer = task.layers[0]
        n = self._spec(layer).train_numel
        acc = dev.pool.grads(layer, task.grad_slots[0] if task.grad_slots else None)[:n]
        stream = self.ctx.grad_streams[layer]
        route = self.optim.download_route(layer)  # before the norm is sent: it may create the host copy
        keep = route.keep
        # replicas: the summed gradient (or this rank's shard); left in the context until the step
        # ends, so its norm tensor outlives the reads queued on this stream
        red = self.ctx.reductions.get(layer)
        if red is not None:
            red.wait()
        lo, hi = (0, n) if red is None else (red.lo, red.hi)
        if red is not None and red.norm_sq is not None:
            norm = red.norm_sq.sqrt()  # the whole layer's, summed over the shards
        else:
            norm = _chunked_norm(acc)
        d2h = dev.streams["d2h"]
        stream.put(GradNorm(norm, dev.backend.record_event(d2h), dev.backend))
        if route.norm_only:  # stepped where it is: only the norm leaves the device
            stream.put(GradEnd())
            return
        if route.round_trip:  # master and moments make the round trip instead of the gradient
            self.optim.step_on_download(layer, dev, acc, norm)
            stream.put(GradEnd())
            return
        pool = dev.grad_pool
        for a in range(lo, hi, pool.chunk):  # chunk offsets relative to the shard (all of it: lo = 0)
            b = min(hi, a + pool.chunk)
            if keep is not None:
                keep[a - lo : b - lo].copy_(acc[a:b], non_blocking=True)
                buf = None
            else:
                buf = pool.acquire(self.ctx.abort)
                buf[: b - a].copy_(acc[a:b], non_blocking=True)
            stream.put(GradChunk(a - lo, b - lo, buf, dev.backend.record_event(d2h), dev.backend, pool))
        stream.put(GradEnd())
        if layer in dev.pool.transient_grads:  # its copies done, its memory goes back for the backward
            dev.backend.sync_event(dev.backend.record_event(d2h))
            del acc
            dev.pool.release_grads(layer)


def _chunked_norm(flat: torch.Tensor) -> torch.Tensor:
    """fp64 norm of a flat fp32 range: fp32 norms of in-place chunks, combined in fp64 -- no
    full-size copy on the device (an fp64 reduction materialised an 8 B/element copy: 3 GB of a 3B
    model's peak)."""
    n = flat.numel()
    norms = [torch.linalg.vector_norm(flat[lo : lo + NORM_CHUNK]) for lo in range(0, n, NORM_CHUNK)]
    return torch.linalg.vector_norm(torch.stack(norms or [flat.sum()]).double())
