"""Execute one schedule: a thread per lane, each running its tasks in order.

Lanes: per device ``compute``, ``h2d`` (uploads) and ``d2h`` (gradient downloads), plus one host
``optimizer`` lane. A task first waits for its dependencies' signals (the host only until the
producer has queued its work; the lane's stream then waits on the producer's event), runs, and
fires its own signal. Any exception aborts the step: every waiting lane notices within a poll
interval and the caller gets the first error with its lane and task.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from tinypipe.errors import NonFiniteError, WorkerError
from tinypipe.memory.host_store import HostStore
from tinypipe.models.decompose import LayerSpec, map_tensors, slice_rows
from tinypipe.models.head import autograd_head_chunk, fused_head_chunk, is_plain_linear
from tinypipe.runtime.buffers import RowBuffer
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.signals import POLL_S, Abort, Aborted, Signal
from tinypipe.runtime.updater import StepUpdater
from tinypipe.schedule.tasks import STREAMING_KINDS, Kind, Schedule, Task


@dataclass
class StepInputs:
    """The global batch, already validated, on the host."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    shifted_labels: torch.Tensor  # labels[:, 1:] padded with -100: position t predicts this
    denom: int  # labelled tokens in the whole global batch

    @property
    def batch(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq(self) -> int:
        return int(self.input_ids.shape[1])


@dataclass
class TaskTiming:
    lane: str
    task: str
    host_start: float
    host_end: float
    events: tuple[object, object] | None = None


@dataclass
class StepState:
    """Buffers and accumulators alive for one step."""

    acts: list[RowBuffer]
    grads: list[RowBuffer]
    contexts: dict[int, list] = field(default_factory=dict)
    context_lock: threading.Lock = field(default_factory=threading.Lock)
    loss_sum: torch.Tensor | None = None
    layer_queues: dict[int, "queue.Queue"] = field(default_factory=dict)
    timings: list[TaskTiming] = field(default_factory=list)
    loss_value: float | None = None


class StepRunner:
    """Runs ``schedule`` once over ``inputs`` with the engine's devices and host store."""

    def __init__(
        self,
        schedule: Schedule,
        inputs: StepInputs,
        devices: list[DeviceRuntime],
        store: HostStore,
        updater: StepUpdater,
        compute_dtype: torch.dtype,
        hidden_size: int,
        head_chunk_tokens: int,
        host_stash: dict[int, torch.Tensor],
        trace: bool,
        fault: Callable[[Task], None] | None = None,
        stall_timeout: float = 300.0,
        check_finite: bool = False,
        optimizer_threads: int | None = None,
        prefetch_pool: dict | None = None,
    ) -> None:
        self.s = schedule
        self.inp = inputs
        self.devices = devices
        self.store = store
        self.updater = updater
        self.dtype = compute_dtype
        self.head_chunk = head_chunk_tokens
        self.trace = trace
        self.fault = fault
        self.abort = Abort()
        self.signals = {tid: Signal() for tid in schedule.tasks}
        self._extra: dict[str, list[object]] = {}  # lane -> side streams the current task used
        self._prefetched: dict[tuple, tuple[torch.Tensor, object]] = {}
        self._current: dict[str, str] = {}
        self.stall_timeout = stall_timeout
        self.check_finite = check_finite
        self.optimizer_threads = optimizer_threads
        self._ring = prefetch_pool if prefetch_pool is not None else {}  # device -> [buffers, next index]
        plan = schedule.plan
        B, S, Hd = inputs.batch, inputs.seq, hidden_size
        P = plan.num_packs
        shape = (B, S, Hd)

        def buffer(dev_index: int, on_host: bool, q: int, kind: str) -> RowBuffer:
            if on_host:
                key = (q if kind == "act" else -1 - q)
                host = host_stash.get(key)
                if host is None or host.shape != shape or host.dtype != compute_dtype:
                    raise RuntimeError(f"host stash for {kind} {q} not prepared")
                return RowBuffer(shape, compute_dtype, None, host=host)
            d = devices[dev_index]
            return RowBuffer(shape, compute_dtype, d.backend, d.streams["compute"])

        acts = []
        for q in range(P + 1):
            owner = plan.embed_device if q == 0 else (plan.fwd_device[q] if q < P else plan.head_device)
            acts.append(buffer(owner, q > 0 and plan.stash_on_host[q], q, "act"))
        grads = []
        for q in range(P + 1):
            owner = plan.embed_device if q == 0 else plan.bwd_device[q - 1]
            grads.append(buffer(owner, False, q, "grad"))
        self.state = StepState(acts=acts, grads=grads)
        self.state.layer_queues = {layer: queue.Queue() for layer in range(schedule.num_layers)}

    # ------------------------------------------------------------------ orchestration

    def run(self) -> StepState:
        threads = []
        for lane, ids in self.s.lanes.items():
            t = threading.Thread(target=self._lane, args=(lane, ids), name=f"tinypipe-{lane}", daemon=True)
            threads.append(t)
            t.start()
        last_progress, last_count = time.monotonic(), 0
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.5)
                count = len(self.state.timings)
                if count != last_count:
                    last_progress, last_count = time.monotonic(), count
                elif time.monotonic() - last_progress > self.stall_timeout and not self.abort.failed:
                    self.abort.fail("watchdog", TimeoutError(
                        f"no task finished for {self.stall_timeout:.0f} s; waiting: {self._waiting()}"))
        if self.abort.error is not None:
            err = self.abort.error
            raise WorkerError(f"{self.abort.where} failed: {type(err).__name__}: {err}") from err
        for d in self.devices:
            d.backend.synchronize()
        return self.state

    def _waiting(self) -> str:
        """Each lane's current task (for stall reports)."""
        return ", ".join(f"{lane}:{tid}" for lane, tid in sorted(self._current.items()) if tid)

    def _lane(self, lane: str, ids: list[str]) -> None:
        tid = ""
        if lane == "host:optimizer" and self.optimizer_threads:
            torch.set_num_threads(self.optimizer_threads)
        dev_index = int(lane[3:].split(":")[0]) if lane.startswith("dev") else -1
        if dev_index >= 0 and self.devices[dev_index].backend.is_cuda:
            torch.cuda.set_device(self.devices[dev_index].device)  # kernels of this lane default here
        try:
            for tid in ids:
                self._current[lane] = tid
                task = self.s.tasks[tid]
                dev = self.devices[task.device] if task.device >= 0 else None
                stream = dev.streams[lane.split(":")[1]] if dev is not None else None
                backend = dev.backend if dev is not None else None
                if task.kind not in STREAMING_KINDS:  # an UPDATE streams its download's chunks
                    for dep in task.deps:
                        self.signals[dep].wait(self.abort, backend, stream)
                start = time.perf_counter()
                ev0 = backend.record_event(stream, timing=True) if (self.trace and backend and backend.is_cuda) else None
                self._extra[lane] = []
                if dev is not None:
                    with dev.backend.use_stream(stream):
                        self._dispatch(task, dev)
                else:
                    self._dispatch(task, None)
                ev1 = backend.record_event(stream, timing=True) if ev0 is not None else None
                self.signals[tid].fire(backend, [stream] + self._extra[lane])
                self.state.timings.append(
                    TaskTiming(lane, tid, start, time.perf_counter(), (ev0, ev1) if ev0 is not None else None)
                )
            self._current[lane] = ""
        except Aborted:
            return
        except BaseException as exc:  # noqa: BLE001 - surfaced to the caller by run()
            self.abort.fail(f"{lane} task {tid}", exc)

    def _dispatch(self, task: Task, dev: DeviceRuntime | None) -> None:
        if self.fault is not None:
            self.fault(task)
        handler = {
            Kind.RESIDENT_UPLOAD: self._upload,
            Kind.UPLOAD: self._upload,
            Kind.EMBED_FWD: self._embed_fwd,
            Kind.FWD: self._fwd,
            Kind.HEAD: self._head,
            Kind.BWD: self._bwd,
            Kind.EMBED_BWD: self._embed_bwd,
            Kind.DOWNLOAD: self._download,
            Kind.UPDATE: self._update,
        }[task.kind]
        handler(task, dev)

    # ------------------------------------------------------------------ helpers

    def _spec(self, layer: int) -> LayerSpec:
        return self.store.layers[layer].spec

    def _bind(self, dev: DeviceRuntime, layer: int, slot: int | None, grad: bool) -> list[torch.Tensor]:
        """Point the shell's parameters of ``layer`` at its device buffer; return them in order."""
        flat = dev.pool.params(layer, slot)
        out = []
        for p in self._spec(layer).params:
            view = flat[p.offset : p.offset + p.numel].view(p.shape)
            if grad:
                view = view.detach().requires_grad_(True)
            dev.shell.bind(p.name, view)
            out.append(view)
        return out

    def _bind_borrowed(self, dev: DeviceRuntime, layer: int, grad: bool) -> list[tuple[torch.Tensor, int, int, int]]:
        """Bind parameters ``layer`` borrows (tied embeddings); returns (tensor, owner, offset, numel)."""
        out = []
        for name, owner in self._spec(layer).borrowed:
            p = next(x for x in self._spec(owner).params if x.name == name)
            view = dev.pool.params(owner, None)[p.offset : p.offset + p.numel].view(p.shape)
            if grad:
                view = view.detach().requires_grad_(True)
            dev.shell.bind(name, view)
            out.append((view, owner, p.offset, p.numel))
        return out

    def _accumulate(self, dev: DeviceRuntime, layer: int, slot: int | None, grads: list[torch.Tensor | None]) -> None:
        acc = dev.pool.grads(layer, slot)
        for p, g in zip(self._spec(layer).params, grads):
            if g is not None:
                acc[p.offset : p.offset + p.numel].view(p.shape).add_(g)

    def _zero_grads(self, dev: DeviceRuntime, layer: int, slot: int | None) -> None:
        dev.pool.grads(layer, slot)[: self._spec(layer).numel].zero_()

    def _check(self, task: Task, what: str, t: torch.Tensor | None) -> None:
        """With ``check_finite``: stop at the first task whose output holds NaN/inf (syncs)."""
        if self.check_finite and t is not None and not bool(torch.isfinite(t).all()):
            raise NonFiniteError(f"{task.id}: non-finite {what}")

    def _context(self, dev: DeviceRuntime) -> list:
        """The block arguments captured by the embedding forward, on ``dev``'s device."""
        with self.state.context_lock:
            ctx = self.state.contexts.get(dev.index)
            if ctx is None:
                src = self.state.contexts[self.s.plan.embed_device]
                ctx = map_tensors(src, lambda t: t.to(dev.device, non_blocking=True))
                self.state.contexts[dev.index] = ctx
            return ctx

    def _rows(self, task: Task, dev: DeviceRuntime, t: torch.Tensor) -> torch.Tensor:
        lo, hi = task.rows
        return t[lo:hi].to(dev.device, non_blocking=True)

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

    # ------------------------------------------------------------------ task handlers

    def _upload(self, task: Task, dev: DeviceRuntime) -> None:
        layer = task.layers[0]
        src = self.store.layers[layer].master
        dst = dev.pool.params(layer, task.slots[0] if task.slots else None)
        staging = dev.pool.staging
        n = src.numel()
        if staging is None:
            dst[:n].copy_(src, non_blocking=True)
            return
        step = staging.numel()
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            staging[: hi - lo].copy_(src[lo:hi], non_blocking=True)
            dst[lo:hi].copy_(staging[: hi - lo])

    def _embed_fwd(self, task: Task, dev: DeviceRuntime) -> None:
        self._bind(dev, 0, None, grad=False)
        ids = self.inp.input_ids.to(dev.device, non_blocking=True)
        mask = self.inp.attention_mask
        mask = mask.to(dev.device, non_blocking=True) if mask is not None else None
        with torch.no_grad():
            hidden, calls = dev.shell.embed_forward(ids, mask)
        with self.state.context_lock:
            self.state.contexts[dev.index] = calls
        buf = self.state.acts[0]
        if buf.device == dev.device and buf.owner is not None:
            buf.adopt(hidden.to(self.dtype))
        else:
            buf.write(0, self.inp.batch, hidden.to(self.dtype))

    def _run_pack(self, task: Task, dev: DeviceRuntime, x: torch.Tensor) -> torch.Tensor:
        ctx = self._context(dev)
        lo, hi = task.rows
        for layer in task.layers:
            call = slice_rows(ctx[layer - 1], lo, hi, self.inp.batch)
            x = dev.shell.block_forward(layer - 1, x, call)
        return x

    def _fwd(self, task: Task, dev: DeviceRuntime) -> None:
        q = task.pack
        for layer, slot in zip(task.layers, task.slots):
            self._bind(dev, layer, slot, grad=False)
        x = self._read_rows(self.state.acts[q], *task.rows, dev)
        self._prefetch_next(task, dev)
        self._check(task, "input", x)
        with torch.no_grad():
            y = self._run_pack(task, dev, x)
        self._check(task, "output", y)
        self._write_rows(self.state.acts[q + 1], *task.rows, y, dev)

    def _head(self, task: Task, dev: DeviceRuntime) -> None:
        H = self.s.num_layers - 1
        P = self.s.plan.num_packs
        spec = self._spec(H)
        tied = bool(spec.borrowed)
        if task.first:
            self._zero_grads(dev, H, None)
            if tied:
                self._zero_grads(dev, 0, None)
            self.state.loss_sum = torch.zeros((), dtype=torch.float64, device=dev.device)
        own = self._bind(dev, H, None, grad=True)
        borrowed = self._bind_borrowed(dev, H, grad=True)
        x = self._read_rows(self.state.acts[P], *task.rows, dev)
        labels = self._rows(task, dev, self.inp.shifted_labels)
        flat_x = x.reshape(-1, x.shape[-1])
        flat_y = labels.reshape(-1)
        grad_x = torch.zeros_like(flat_x)
        denom = float(self.inp.denom)
        shell = dev.shell
        wname = shell.decomposition.head_weight_name
        fast = wname is not None and is_plain_linear(shell.lm_head)
        if fast:
            owner, wslice = shell.decomposition.locate(wname)
            wacc = dev.pool.grads(owner, None)[wslice.offset : wslice.offset + wslice.numel].view(wslice.shape)
            post = [(p, t) for p, t in zip(spec.params, own) if p.name != wname]
            post_params = [t for _, t in post]
        lo, hi = task.rows
        host_y = self.inp.shifted_labels[lo:hi].reshape(-1)  # decide skips on the host: no device sync
        for c0 in range(0, flat_x.shape[0], self.head_chunk):
            c1 = min(flat_x.shape[0], c0 + self.head_chunk)
            y = flat_y[c0:c1]
            if not bool((host_y[c0:c1] != -100).any()):
                continue
            if fast:
                loss, gx, pgrads, _ = fused_head_chunk(shell.post, shell.lm_head, flat_x[c0:c1], y, denom,
                                                       post_params, wacc)
                acc = dev.pool.grads(H, None)
                for (p, _), g in zip(post, pgrads):
                    if g is not None:
                        acc[p.offset : p.offset + p.numel].view(p.shape).add_(g)
            else:
                params = own + [b[0] for b in borrowed]
                loss, gx, grads = autograd_head_chunk(shell.head_logits, flat_x[c0:c1], y, denom, params)
                self._accumulate(dev, H, None, grads[: len(own)])
                for (view, owner, off, n), g in zip(borrowed, grads[len(own) :]):
                    if g is not None:
                        dev.pool.grads(owner, None)[off : off + n].view(view.shape).add_(g)
            grad_x[c0:c1] = gx
            self._check(task, "loss", loss)
            self._check(task, "input gradient", gx)
            self.state.loss_sum += loss.double()
        self.state.grads[P].write(*task.rows, grad_x.view_as(x))
        if task.last and self.state.acts[P].owner is not None:
            self.state.acts[P].free()

    def _bwd(self, task: Task, dev: DeviceRuntime) -> None:
        q = task.pack
        if task.first:
            for layer, g in zip(task.layers, task.grad_slots):
                self._zero_grads(dev, layer, g)
        params: list[torch.Tensor] = []
        counts = []
        for layer, slot in zip(task.layers, task.slots):
            ps = self._bind(dev, layer, slot, grad=True)
            params += ps
            counts.append(len(ps))
        x = self._read_rows(self.state.acts[q], *task.rows, dev).detach().requires_grad_(True)
        self._prefetch_next(task, dev)
        gout = self.state.grads[q + 1].read(*task.rows, dev.device)
        with torch.enable_grad():
            y = self._run_pack(task, dev, x)
        self._check(task, "stashed input", x)
        self._check(task, "output gradient", gout)
        grads = torch.autograd.grad(y, [x] + params, gout, allow_unused=True)
        self._check(task, "input gradient", grads[0])
        for g in grads[1:]:
            self._check(task, "parameter gradient", g)
        self.state.grads[q].write(*task.rows, grads[0])
        i = 1
        for layer, g, n in zip(task.layers, task.grad_slots, counts):
            self._accumulate(dev, layer, g, list(grads[i : i + n]))
            i += n
        del y, grads, x, gout
        if task.last:
            self.state.grads[q + 1].free()
            if q > 0:
                self.state.acts[q].free()

    def _embed_bwd(self, task: Task, dev: DeviceRuntime) -> None:
        if not self._spec(self.s.num_layers - 1).borrowed or self.s.plan.head_device != dev.index:
            self._zero_grads(dev, 0, None)
        params = self._bind(dev, 0, None, grad=True)
        ids = self.inp.input_ids.to(dev.device, non_blocking=True)
        mask = self.inp.attention_mask
        mask = mask.to(dev.device, non_blocking=True) if mask is not None else None
        gout = self.state.grads[0].read(0, self.inp.batch, dev.device)
        with torch.enable_grad():
            hidden, _ = dev.shell.embed_forward(ids, mask)
        grads = torch.autograd.grad(hidden.to(self.dtype), params, gout, allow_unused=True)
        self._accumulate(dev, 0, None, list(grads))
        self.state.grads[0].free()
        self.state.acts[0].free()

    def _download(self, task: Task, dev: DeviceRuntime) -> None:
        layer = task.layers[0]
        n = self._spec(layer).numel
        acc = dev.pool.grads(layer, task.grad_slots[0] if task.grad_slots else None)[:n]
        q = self.state.layer_queues[layer]
        norm = torch.linalg.vector_norm(acc, dtype=torch.float64)
        q.put(("norm", norm, dev.backend.record_event(dev.streams["d2h"]), dev))
        pool = dev.grad_pool
        for lo in range(0, n, pool.chunk):
            hi = min(n, lo + pool.chunk)
            buf = pool.acquire(self.abort)
            buf[: hi - lo].copy_(acc[lo:hi], non_blocking=True)
            q.put(("chunk", (lo, hi, buf), dev.backend.record_event(dev.streams["d2h"]), dev))
        q.put(("end", None, None, dev))

    def _get(self, q: "queue.Queue") -> tuple:
        while True:
            try:
                return q.get(timeout=POLL_S)
            except queue.Empty:
                self.abort.check()

    def _update(self, task: Task, dev: None) -> None:
        layer = task.layers[0]
        q = self.state.layer_queues[layer]
        kind, norm, event, src = self._get(q)
        assert kind == "norm"
        src.backend.sync_event(event)
        norm_sq = float(norm.item()) ** 2
        loss_finite = True
        if layer == self.s.num_layers - 1:  # the head's update runs first: check the loss
            H_last = f"head/{len(self.s.fwd_rows()) - 1}"
            self.signals[H_last].synchronize(self.abort)
            self.state.loss_value = float(self.state.loss_sum.item()) if self.state.loss_sum is not None else 0.0
            loss_finite = bool(torch.isfinite(torch.tensor(self.state.loss_value)))
        decision = self.updater.decide(layer, norm_sq, loss_finite)
        state = self.store.layers[layer]
        keep = self.updater.retain_buffer(layer)
        step_no = state.step + 1
        while True:
            kind, payload, event, src = self._get(q)
            if kind == "end":
                break
            lo, hi, buf = payload
            src.backend.sync_event(event)
            grad = buf[: hi - lo]
            if keep is not None:
                keep[lo:hi].copy_(grad)
            if decision == "step":
                self.updater.optimizer.step(state, lo, hi, grad, step_no, self.updater.lr)
            src.grad_pool.release(buf)
        if decision == "step":
            state.step = step_no


def host_times(timings: list[TaskTiming], origin: float) -> list[dict]:
    """Timings as trace events (microseconds since ``origin``; device events when recorded)."""
    out = []
    for t in timings:
        out.append({
            "lane": t.lane,
            "name": t.task,
            "start_us": (t.host_start - origin) * 1e6,
            "dur_us": (t.host_end - t.host_start) * 1e6,
        })
    return out
