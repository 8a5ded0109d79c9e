"""What each task kind does on its device: uploads, the three model stages, gradient downloads and
the host update (handed to the optimizer path). One :class:`TaskHandlers` per step, given the
step's :class:`~tinypipe.runtime.context.StepContext` and the engine's
:class:`~tinypipe.runtime.resources.EngineResources`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tinypipe.distributed.reduce import reduce_gradient
from tinypipe.errors import NonFiniteError
from tinypipe.models.decompose import LayerSpec, map_tensors, slice_rows
from tinypipe.models.head import autograd_head_chunk, fused_head_chunk, is_plain_linear
from tinypipe.runtime.context import StepContext, TaskTiming
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.host_kept import HostKeptGraph, prefetch_order
from tinypipe.runtime.optim.messages import GradChunk, GradEnd, GradNorm
from tinypipe.runtime.resources import EngineResources
from tinypipe.runtime.rng import EMBED, HEAD, PACK, TaskRng, replay_pieces
from tinypipe.runtime.stash_io import StashIO
from tinypipe.runtime.upload import upload_layer
from tinypipe.runtime.weight_refs import WeightRefs
from tinypipe.schedule.ids import Kind, Lane, head_id
from tinypipe.schedule.tasks import COMPUTE_KINDS, Task


NORM_CHUNK = 1 << 24  # elements per partial gradient norm


@dataclass
class KeptGraph:
    """One forward micro-batch of a kept pack: its input leaf, its output (whose graph holds the
    saved activations), the weights it was bound to (trainable ones, in layer order), how many
    of them each layer has, and the references its saved weights were stored as."""

    input: torch.Tensor
    output: torch.Tensor
    params: list[torch.Tensor]
    counts: list[int]
    refs: WeightRefs
    host: HostKeptGraph | None = None  # its saved activations in host memory (Plan.kept_on_host)


class TaskHandlers:
    """Task handlers of one step and the binding/accumulation helpers they share."""

    def __init__(self, res: EngineResources, ctx: StepContext) -> None:
        self.res = res
        self.ctx = ctx
        self.store = res.store
        self.optim = res.optimizer
        self.dtype = res.compute_dtype
        self.stash = StashIO(ctx, res.read_ahead)
        self._rng: dict[int, TaskRng] = {}  # device entry -> its running compute task's generator hold
        self._drew: dict[tuple[int, int], bool] = {}  # (pack, forward micro-batch) -> its forward drew
        # (kept pack, forward micro-batch) -> its forward's graph, until its backward differentiates it
        self._kept: dict[tuple[int, int], KeptGraph] = {}
        # compute task -> the host-kept graphs it starts copying back when done (runtime/host_kept.py)
        self._prefetch = prefetch_order(ctx.schedule)
        self._going_down: dict[int, list[HostKeptGraph]] = {}  # device entry -> graphs being offloaded
        self._by_kind: dict[Kind, Callable[[Task, DeviceRuntime], None]] = {
            Kind.RESIDENT_UPLOAD: self._upload,
            Kind.UPLOAD: self._upload,
            Kind.EMBED_FWD: self._embed_fwd,
            Kind.FWD: self._fwd,
            Kind.HEAD: self._head,
            Kind.BWD: self._bwd,
            Kind.EMBED_BWD: self._embed_bwd,
            Kind.REDUCE: self._reduce,
            Kind.DOWNLOAD: self._download,
            Kind.UPDATE: self._update,
        }

    def run(self, task: Task, dev: DeviceRuntime | None) -> None:
        """Run ``task`` (``dev``: its device; None for a host task)."""
        if self.ctx.fault is not None:
            self.ctx.fault(task)
        rng = self.res.rng
        if rng is None or dev is None or task.kind not in COMPUTE_KINDS:
            self._by_kind[task.kind](task, dev)  # type: ignore[arg-type]
            return
        with rng.task(dev.device, self.optim.step_count) as held:  # see runtime/rng.py
            self._rng[dev.index] = held
            try:
                self._by_kind[task.kind](task, dev)
            finally:
                del self._rng[dev.index]

    def _seed(self, dev: DeviceRuntime, *key: int | str) -> None:
        """Put ``dev``'s generator into the state of stage ``key`` (dropout on; else nothing)."""
        held = self._rng.get(dev.index)
        if held is not None:
            held.seed(*key)

    def _spec(self, layer: int) -> LayerSpec:
        return self.store.layers[layer].spec

    def _bind(self, dev: DeviceRuntime, layer: int, slot: int | None, grad: bool) -> list[torch.Tensor]:
        """Point the shell's parameters of ``layer`` at its device buffer; return them in order
        (with ``grad``: only the trainable ones, ready for autograd; frozen ones are bound too)."""
        flat = dev.pool.params(layer, slot)
        out = []
        for p in self._spec(layer).params:
            view = flat[p.offset : p.offset + p.numel].view(p.shape)
            if grad and p.trainable:
                view = view.detach().requires_grad_(True)
            dev.shell.bind(p.name, view)
            if p.trainable or not grad:
                out.append(view)
        return out

    def _bind_borrowed(self, dev: DeviceRuntime, layer: int,
                       grad: bool) -> list[tuple[torch.Tensor, int, int, int]]:
        """Bind parameters ``layer`` borrows (tied embeddings); returns (tensor, owner, offset, numel)."""
        out = []
        for name, owner in self._spec(layer).borrowed:
            p = next(x for x in self._spec(owner).params if x.name == name)
            view = dev.pool.params(owner, None)[p.offset : p.offset + p.numel].view(p.shape)
            if grad and p.trainable:
                view = view.detach().requires_grad_(True)
            dev.shell.bind(name, view)
            if p.trainable or not grad:
                out.append((view, owner, p.offset, p.numel))
        return out

    def _accumulate(self, dev: DeviceRuntime, layer: int, slot: int | None,
                    grads: list[torch.Tensor | None]) -> None:
        acc = dev.pool.grads(layer, slot)
        for p, g in zip(self._spec(layer).trainable_params, grads):
            if g is not None:
                acc[p.offset : p.offset + p.numel].view(p.shape).add_(g)

    def _zero_grads(self, dev: DeviceRuntime, layer: int, slot: int | None) -> None:
        dev.pool.grads(layer, slot)[: self._spec(layer).train_numel].zero_()

    def _check(self, task: Task, what: str, t: torch.Tensor | None) -> None:
        """With ``check_finite``: stop at the first task whose output holds NaN/inf (syncs)."""
        if self.res.check_finite and t is not None and not bool(torch.isfinite(t).all()):
            raise NonFiniteError(f"{task.id}: non-finite {what}")

    def _block_calls(self, dev: DeviceRuntime) -> list:
        """The block arguments captured by the embedding forward, on ``dev``'s device."""
        ctx = self.ctx
        with ctx.block_calls_lock:
            calls = ctx.block_calls.get(dev.index)
            if calls is None:
                src = ctx.block_calls[ctx.schedule.plan.embed_device]
                calls = map_tensors(src, lambda t: t.to(dev.device, non_blocking=True))
                ctx.block_calls[dev.index] = calls
            return calls

    def _rows(self, task: Task, dev: DeviceRuntime, t: torch.Tensor) -> torch.Tensor:
        lo, hi = task.rows
        return t[lo:hi].to(dev.device, non_blocking=True)

    def _upload(self, task: Task, dev: DeviceRuntime) -> None:
        layer = task.layers[0]
        dst = dev.pool.params(layer, task.slots[0] if task.slots else None)
        upload_layer(self.store, self.optim, dev, layer, dst, self.ctx.abort, task_id=task.id)

    def _embed_fwd(self, task: Task, dev: DeviceRuntime) -> None:
        self._bind(dev, 0, None, grad=False)
        inp = self.ctx.inputs
        ids = inp.input_ids.to(dev.device, non_blocking=True)
        mask = inp.attention_mask
        mask = mask.to(dev.device, non_blocking=True) if mask is not None else None
        self._seed(dev, EMBED)
        with torch.no_grad():
            hidden, calls = dev.shell.embed_forward(ids, mask, self._positions(dev))
        with self.ctx.block_calls_lock:
            self.ctx.block_calls[dev.index] = calls
        buf = self.ctx.acts[0]
        if buf.device == dev.device and buf.owner is not None:
            buf.adopt(hidden.to(self.dtype))
        else:
            buf.write(0, inp.batch, hidden.to(self.dtype))

    def _positions(self, dev: DeviceRuntime) -> torch.Tensor | None:
        pos = self.ctx.inputs.position_ids
        return pos.to(dev.device, non_blocking=True) if pos is not None else None

    def _run_pack(self, task: Task, dev: DeviceRuntime, x: torch.Tensor,
                  rows: tuple[int, int] | None = None, compact: bool = False) -> torch.Tensor:
        calls = self._block_calls(dev)
        lo, hi = rows or task.rows
        for layer in task.layers:
            call = slice_rows(calls[layer - 1], lo, hi, self.ctx.inputs.batch)
            x = dev.shell.block_forward(layer - 1, x, call, compact=compact)
        return x

    def _compact(self, dev: DeviceRuntime) -> bool:
        """Whether a kept forward saves the compact set (models/compact.py): not once a kept
        forward drew random numbers (dropout: the compact recompute of the elementwise ops could
        not replay the masks) nor over a QLoRA base (its matmuls are bitsandbytes' own ops, which
        the compact set would recompute)."""
        return self.res.kept_saving.compact and not dev.shell.quantized

    def _fwd(self, task: Task, dev: DeviceRuntime) -> None:
        q = task.pack
        if self.ctx.schedule.plan.kept(q):
            self._fwd_kept(task, dev)
            return
        for layer, slot in zip(task.layers, task.slots):
            self._bind(dev, layer, slot, grad=False)
        x = self.stash.read_rows(self.ctx.acts[q], *task.rows, dev)
        self.stash.read_ahead_next(task, dev)
        y = self._forward_seeded(task, dev, x, record=False)
        self.stash.write_rows(self.ctx.acts[q + 1], *task.rows, y, dev)

    def _forward_seeded(self, task: Task, dev: DeviceRuntime, x: torch.Tensor, *,
                        record: bool) -> torch.Tensor:
        """The pack's forward micro-batch under its seed, noting whether it drew random numbers
        (a recompute replays them); ``record``: with autograd recording (a kept pack)."""
        self._check(task, "input", x)
        self._seed(dev, PACK, task.pack, task.mb)
        # (a host-kept eager graph saves in full: an eager compact graph's cache bypasses the hooks)
        compact = record and self._compact(dev) and (
            dev.shell.compiled or not self.ctx.schedule.plan.on_host(task.pack))
        with torch.enable_grad() if record else torch.no_grad():
            y = self._run_pack(task, dev, x, compact=compact)
        held = self._rng.get(dev.index)
        drew = held is not None and held.drew()
        if compact and drew:  # its recompute could not replay the masks: record it in full, same masks
            self.res.kept_saving.compact = False
            del y
            self._seed(dev, PACK, task.pack, task.mb)
            with torch.enable_grad():
                y = self._run_pack(task, dev, x)
        self._drew[(task.pack, task.mb)] = drew
        self._check(task, "output", y)
        return y

    def _bind_trainable(self, task: Task, dev: DeviceRuntime) -> tuple[list[torch.Tensor], list[int]]:
        """The pack's layers bound as requires-grad views of their slots: every layer's parameters
        in order, and how many each layer has (to split the gradients back per layer)."""
        params: list[torch.Tensor] = []
        counts = []
        for layer, slot in zip(task.layers, task.slots):
            ps = self._bind(dev, layer, slot, grad=True)
            params += ps
            counts.append(len(ps))
        return params, counts

    def _fwd_kept(self, task: Task, dev: DeviceRuntime) -> None:
        """A kept pack's forward micro-batch: autograd records it (weights bound as requires-grad
        views of the pack's buffers, the input a detached leaf) and the graph waits on the device
        for the backward (:meth:`_bwd_kept`). What it saves of the weights is saved by reference
        (:class:`~tinypipe.runtime.weight_refs.WeightRefs`), so the slots may be refilled before
        the backward, which re-reads the weights from its own. The input is read without
        read-ahead: the graph may save it, and a read-ahead buffer is reused two reads later.
        Dropout's masks live in the graph, so nothing is replayed; the generator is seeded as for
        a recomputed pack, which keeps the masks -- and the results -- the same with and without
        keeping."""
        q, ctx = task.pack, self.ctx
        params, counts = self._bind_trainable(task, dev)
        host = None
        if ctx.schedule.plan.on_host(q):
            going = self._going_down.setdefault(dev.index, [])
            while len(going) >= 2:  # at most two graphs on their way down (runtime/host_kept.py)
                going.pop(0).wait_down()
            host = HostKeptGraph(self.res.host_kept, q, task.mb, dev)
            going.append(host)
            refs = WeightRefs(self._pack_buffers(task, dev), host.offload, host.restore)
        else:
            refs = WeightRefs(self._pack_buffers(task, dev))
        x = self.stash.read_rows(ctx.acts[q], *task.rows, dev).detach().requires_grad_(True)
        with refs.saving():
            y = self._forward_seeded(task, dev, x, record=True)
        self.stash.write_rows(ctx.acts[q + 1], *task.rows, y.detach(), dev)
        self._kept[(q, task.mb)] = KeptGraph(x, y, params, counts, refs, host)
        if task.last and q > 0:  # the backward reads no stash: what the graphs saved of it is theirs
            ctx.acts[q].free()  # (the embedding's output, acts[0], stays for the embedding's backward)

    def _pack_buffers(self, task: Task, dev: DeviceRuntime) -> dict[int, torch.Tensor]:
        """Layer -> the device buffer ``task`` computes it in (its slot, or its resident buffer)."""
        return {layer: dev.pool.params(layer, slot) for layer, slot in zip(task.layers, task.slots)}

    def _head(self, task: Task, dev: DeviceRuntime) -> None:
        ctx, inp = self.ctx, self.ctx.inputs
        H = ctx.schedule.num_layers - 1
        P = ctx.schedule.plan.num_packs
        spec = self._spec(H)
        tied = bool(spec.borrowed)
        if task.first:
            self._zero_grads(dev, H, None)
            if tied:
                self._zero_grads(dev, 0, None)
            ctx.loss_sum = torch.zeros((), dtype=torch.float64, device=dev.device)
        own = self._bind(dev, H, None, grad=True)
        borrowed = self._bind_borrowed(dev, H, grad=True)
        self._seed(dev, HEAD, task.mb)
        x = self.stash.read_rows(ctx.acts[P], *task.rows, dev)
        labels = self._rows(task, dev, inp.shifted_labels)
        flat_x = x.reshape(-1, x.shape[-1])
        flat_y = labels.reshape(-1)
        grad_x = torch.zeros_like(flat_x)
        denom = float(inp.denom)
        shell = dev.shell
        wname = shell.decomposition.head_weight_name
        fast = wname is not None and is_plain_linear(shell.lm_head)
        if fast:
            owner, wslice = shell.decomposition.locate(wname)
            wtrain = wslice.trainable
            wacc = None  # a frozen output embedding (LoRA) gets no weight gradient
            if wtrain:
                wacc = dev.pool.grads(owner, None)[wslice.offset : wslice.offset + wslice.numel]
                wacc = wacc.view(wslice.shape)
            post = [(p, t) for p, t in zip(spec.trainable_params, own) if p.name != wname]
            post_params = [t for _, t in post]
        lo, hi = task.rows
        host_y = inp.shifted_labels[lo:hi].reshape(-1)  # decide skips on the host: no device sync
        chunk = self.res.head_chunk_tokens
        for c0 in range(0, flat_x.shape[0], chunk):
            c1 = min(flat_x.shape[0], c0 + chunk)
            y = flat_y[c0:c1]
            if not bool((host_y[c0:c1] != -100).any()):
                continue
            if fast:
                loss, gx, pgrads, _ = fused_head_chunk(shell.post, shell.lm_head, flat_x[c0:c1], y, denom,
                                                       post_params, wacc, weight_grad=wtrain,
                                                       loss_grad=self.res.head_loss)
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
            ctx.loss_sum += loss.double()  # type: ignore[operator]
        ctx.grads[P].write(*task.rows, grad_x.view_as(x))
        self._start_prefetch(task)
        if task.last and ctx.acts[P].owner is not None:
            ctx.acts[P].free()

    def _bwd(self, task: Task, dev: DeviceRuntime) -> None:
        q = task.pack
        if task.first:
            for layer, g in zip(task.layers, task.grad_slots):
                self._zero_grads(dev, layer, g)
        if self.ctx.schedule.plan.kept(q):
            self._bwd_kept(task, dev)
            return
        params, counts = self._bind_trainable(task, dev)
        ctx = self.ctx
        x = self.stash.read_rows(ctx.acts[q], *task.rows, dev).detach().requires_grad_(True)
        self.stash.read_ahead_next(task, dev)
        gout = self.stash.read_rows(ctx.grads[q + 1], *task.rows, dev)
        span = self._span_open(task, dev) if self.res.trace else None
        with torch.enable_grad():
            y = self._recompute(task, dev, x)
        if span is not None:
            self._span_close(task, dev, "recompute", span)
        self._check(task, "stashed input", x)
        self._check(task, "output gradient", gout)
        grads = torch.autograd.grad(y, [x] + params, gout, allow_unused=True)
        self._store_grads(task, dev, task.rows, grads, counts)
        del y, grads, x, gout
        self._bwd_done(task)

    def _store_grads(self, task: Task, dev: DeviceRuntime, rows: tuple[int, int],
                     grads: Sequence[torch.Tensor | None], counts: list[int]) -> None:
        """A backward's results for ``rows``: the input gradient (``grads[0]``) to the previous
        pack, the parameter gradients (then ``counts[i]`` per layer) into the layers' accumulators."""
        self._check(task, "input gradient", grads[0])
        for g in grads[1:]:
            self._check(task, "parameter gradient", g)
        self.stash.write_rows(self.ctx.grads[task.pack], *rows, grads[0], dev)  # host rows: side stream
        i = 1
        for layer, g, n in zip(task.layers, task.grad_slots, counts):
            self._accumulate(dev, layer, g, list(grads[i : i + n]))
            i += n

    def _bwd_done(self, task: Task) -> None:
        """After a backward micro-batch: start copying back the host-kept graphs the lane's next
        backward differentiates; after a pack's last one: free its output gradient and its input
        stash (the embedding's output, acts[0], stays for the embedding's backward)."""
        self._start_prefetch(task)
        if task.last:
            q = task.pack
            self.ctx.grads[q + 1].free()
            if q > 0:
                self.ctx.acts[q].free()

    def _bwd_kept(self, task: Task, dev: DeviceRuntime) -> None:
        """A kept pack's backward micro-batch: autograd through the graph of each forward
        micro-batch in its rows (whole ones: the plan and the validator see to it), in row order,
        each freed once differentiated -- no stash read, no replayed draws. The saved weights are
        read from this task's buffers (the forward's slots may hold other layers by now), and the
        layers are bound to them: a compact graph (models/compact.py) recomputes its elementwise
        ops through the blocks, in eager mode reading the weights they are bound to."""
        q, ctx = task.pack, self.ctx
        lo, hi = task.rows
        gout = self.stash.read_rows(ctx.grads[q + 1], lo, hi, dev)
        self._check(task, "output gradient", gout)
        self._rebind_kept(task, dev)
        buffers = self._pack_buffers(task, dev)
        for m, a, b in replay_pieces(ctx.schedule.fwd_rows(), lo, hi):
            kept = self._kept.pop((q, m))
            kept.refs.rebind(buffers)
            if kept.host is not None:
                kept.host.ready()
            grads = torch.autograd.grad(kept.output, [kept.input] + kept.params, gout[a - lo : b - lo],
                                        allow_unused=True)
            self._store_grads(task, dev, (a, b), grads, kept.counts)
            del grads, kept  # the last reference to this graph: its saved tensors go with it
        del gout
        self._bwd_done(task)

    def _start_prefetch(self, task: Task) -> None:
        """Copy back the host-kept graphs of the lane's next backward task (one task ahead)."""
        for key in self._prefetch.get(task.id, ()):
            kept = self._kept.get(key)
            if kept is not None and kept.host is not None:
                kept.host.prefetch()

    def _rebind_kept(self, task: Task, dev: DeviceRuntime) -> None:
        """Bind a kept pack's layers to its backward's buffers as its forward bound them (requires-
        grad views): a compact graph's recompute then reads these weights and saves what the
        forward saved."""
        self._bind_trainable(task, dev)

    def _span_open(self, task: Task, dev: DeviceRuntime) -> tuple[float, object | None]:
        """A traced sub-span's start, taken as the lane takes a task's: host time, then (CUDA) a
        timing event on the task's lane stream -- the stream the task's kernels are queued on."""
        start = time.perf_counter()
        if not dev.backend.is_cuda:
            return start, None
        return start, dev.backend.record_event(dev.streams[Lane.parse(task.lane).name], timing=True)

    def _span_close(self, task: Task, dev: DeviceRuntime, what: str,
                    opened: tuple[float, object | None]) -> None:
        """Record the sub-span ``<task id>/<what>`` opened by :meth:`_span_open` in the step's
        timings (its own timeline event on the task's lane, inside the task's)."""
        start, ev0 = opened
        ev1 = None
        if ev0 is not None:
            ev1 = dev.backend.record_event(dev.streams[Lane.parse(task.lane).name], timing=True)
        self.ctx.timings.append(TaskTiming(task.lane, f"{task.id}/{what}", start, time.perf_counter(),
                                           (ev0, ev1) if ev0 is not None else None, parent=task.id))

    def _recompute(self, task: Task, dev: DeviceRuntime, x: torch.Tensor) -> torch.Tensor:
        """The pack's output on the backward micro-batch's rows, drawing what the forward drew:
        one forward micro-batch at a time under its seed when any of them drew random numbers
        (see :func:`~tinypipe.runtime.rng.replay_pieces`), else in one go."""
        q, (lo, hi) = task.pack, task.rows
        pieces = replay_pieces(self.ctx.schedule.fwd_rows(), lo, hi)
        if not any(self._drew.get((q, m), False) for m, _, _ in pieces):
            return self._run_pack(task, dev, x)
        outs = []
        for m, a, b in pieces:
            s0, s1 = max(a, lo), min(b, hi)  # this task's rows of forward micro-batch m
            parts = [x[s0 - lo : s1 - lo]]
            if a < s0:  # rows of the forward micro-batch outside this task: inputs only
                parts.insert(0, self.stash.read_rows(self.ctx.acts[q], a, s0, dev))
            if s1 < b:
                parts.append(self.stash.read_rows(self.ctx.acts[q], s1, b, dev))
            self._seed(dev, PACK, q, m)
            y = self._run_pack(task, dev, parts[0] if len(parts) == 1 else torch.cat(parts), (a, b))
            outs.append(y[s0 - a : s1 - a])
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _embed_bwd(self, task: Task, dev: DeviceRuntime) -> None:
        ctx, inp = self.ctx, self.ctx.inputs
        tied = bool(self._spec(ctx.schedule.num_layers - 1).borrowed)
        head_shares = tied and ctx.schedule.plan.head_device == dev.index
        if not head_shares:  # a tied head on this device zeroed the embedding's gradient already
            self._zero_grads(dev, 0, None)
        if not self._spec(0).train_numel:  # frozen embedding (LoRA): nothing to differentiate
            ctx.grads[0].free()
            ctx.acts[0].free()
            return
        params = self._bind(dev, 0, None, grad=True)
        ids = inp.input_ids.to(dev.device, non_blocking=True)
        mask = inp.attention_mask
        mask = mask.to(dev.device, non_blocking=True) if mask is not None else None
        gout = ctx.grads[0].read(0, inp.batch, dev.device)
        self._seed(dev, EMBED)
        with torch.enable_grad():
            hidden, _ = dev.shell.embed_forward(ids, mask, self._positions(dev))
        grads = torch.autograd.grad(hidden.to(self.dtype), params, gout, allow_unused=True)
        self._accumulate(dev, 0, None, list(grads))
        ctx.grads[0].free()
        ctx.acts[0].free()

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

    def _update(self, task: Task, dev: None) -> None:
        layer = task.layers[0]
        head = layer == self.ctx.schedule.num_layers - 1  # the head's update runs first: check the loss
        self.optim.consume(layer, self.ctx.grad_streams[layer], self.ctx.abort,
                           self._loss_finite if head else None)

    def _loss_finite(self) -> bool:
        """The step's loss, on the host once the head's last micro-batch is done: finite?"""
        ctx = self.ctx
        ctx.signals[head_id(len(ctx.schedule.fwd_rows()) - 1)].synchronize(ctx.abort)
        ctx.loss_value = float(ctx.loss_sum.item()) if ctx.loss_sum is not None else 0.0
        if self.res.replicas is not None:  # the global batch's loss: one skip decision on every rank
            ctx.loss_value = self.res.replicas.host.sum_scalar(ctx.loss_value)
        return bool(torch.isfinite(torch.tensor(ctx.loss_value)))


def _chunked_norm(flat: torch.Tensor) -> torch.Tensor:
    """fp64 norm of a flat fp32 range: fp32 norms of in-place chunks, combined in fp64 -- no
    full-size copy on the device (an fp64 reduction materialised an 8 B/element copy: 3 GB of a 3B
    model's peak)."""
    n = flat.numel()
    norms = [torch.linalg.vector_norm(flat[lo : lo + NORM_CHUNK]) for lo in range(0, n, NORM_CHUNK)]
    return torch.linalg.vector_norm(torch.stack(norms or [flat.sum()]).double())
