"""The compute tasks of a step: the embedding, the packs' forward (recorded when the pack keeps
its graph), the fused head (loss and its gradient), the packs' backward (a recompute from the stash,
or the kept graph differentiated) and the embedding's backward -- with dropout's draws replayed
exactly and traced sub-spans."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from tinypipe.models.decompose import map_tensors, slice_rows
from tinypipe.models.head import autograd_head_chunk, fused_head_chunk, is_plain_linear
from tinypipe.runtime.context import StepContext, TaskTiming
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.handler_base import HandlerBase
from tinypipe.runtime.host_kept import HostKeptGraph, prefetch_order
from tinypipe.runtime.resources import EngineResources
from tinypipe.runtime.rng import EMBED, HEAD, PACK, replay_pieces
from tinypipe.runtime.stash_io import StashIO
from tinypipe.runtime.weight_refs import WeightRefs
from tinypipe.schedule.tasks import Task


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


class ComputeHandlers(HandlerBase):
    """The forward, head and backward tasks of one step, and the stash and kept graphs between them."""

    def __init__(self, res: EngineResources, ctx: StepContext) -> None:
        super().__init__(res, ctx)
        self.stash = StashIO(ctx, res.read_ahead)
        self._drew: dict[tuple[int, int], bool] = {}  # (pack, forward micro-batch) -> its forward drew
        self._embed_drew = False  # the embedding's forward drew random numbers (dropout after it)
        # (kept pack, forward micro-batch) -> its forward's graph, until its backward differentiates it
        self._kept: dict[tuple[int, int], KeptGraph] = {}
        # compute task -> the host-kept graphs it starts copying back when done (runtime/host_kept.py)
        self._prefetch = prefetch_order(ctx.schedule)
        self._going_down: dict[int, list[HostKeptGraph]] = {}  # device entry -> graphs being offloaded

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
        self._embed_drew = self._drew_now(dev)
        self._release_weights(dev, 0)
        buf = self.ctx.acts[0]
        if buf.owner is None:  # in host memory (long sequences): one forward micro-batch at a time
            out = hidden.to(self.dtype)
            for lo, hi in self.ctx.schedule.fwd_rows():
                self.stash.write_rows(buf, lo, hi, out[lo:hi], dev)
        elif buf.device == dev.device:
            buf.adopt(hidden.to(self.dtype))
        else:
            buf.write(0, inp.batch, hidden.to(self.dtype))

    def _release_weights(self, dev: DeviceRuntime, layer: int) -> None:
        """Free ``layer``'s transient weight buffer (schedule/transient_grads.py) once the kernels
        queued on this compute stream have read it; the shell lets go of its views first."""
        if layer not in dev.pool.transient_weights:
            return
        dev.backend.sync_event(dev.backend.record_event(dev.streams["compute"]))
        for p in self._spec(layer).params:
            dev.shell.bind(p.name, torch.empty(p.shape, dtype=self.dtype, device="meta"))
        dev.pool.release_params(layer)

    def _drew_now(self, dev: DeviceRuntime) -> bool:
        """Whether ``dev``'s running compute task drew random numbers since its last seed."""
        held = self._rng.get(dev.index)
        return held is not None and held.drew()

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
        drew = self._drew_now(dev)
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
        if task.last:
            self._release_weights(dev, H)
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
        return start, dev.backend.record_event(dev.streams[task.lane.name], timing=True)

    def _span_close(self, task: Task, dev: DeviceRuntime, what: str,
                    opened: tuple[float, object | None]) -> None:
        """Record the sub-span ``<task id>/<what>`` opened by :meth:`_span_open` in the step's
        timings (its own timeline event on the task's lane, inside the task's)."""
        start, ev0 = opened
        ev1 = None
        if ev0 is not None:
            ev1 = dev.backend.record_event(dev.streams[task.lane.name], timing=True)
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
        # the input gradient in host memory (long sequences): one forward micro-batch's rows at a
        # time, the next one's read ahead -- unless the forward drew random numbers (dropout after
        # the embedding), whose masks only a recompute of the whole batch replays
        if ctx.grads[0].owner is None and not self._embed_drew:
            rows = ctx.schedule.fwd_rows()
        else:
            rows = [(0, inp.batch)]
        for i, (lo, hi) in enumerate(rows):
            gout = self.stash.read_rows(ctx.grads[0], lo, hi, dev)
            if i + 1 < len(rows):
                self.stash.read_ahead_gradient(*rows[i + 1], dev)
            self._check(task, "output gradient", gout)
            ids = inp.input_ids[lo:hi].to(dev.device, non_blocking=True)
            mask = inp.attention_mask
            mask = mask[lo:hi].to(dev.device, non_blocking=True) if mask is not None else None
            pos = inp.position_ids
            pos = pos[lo:hi].to(dev.device, non_blocking=True) if pos is not None else None
            self._seed(dev, EMBED)
            with torch.enable_grad():
                hidden, _ = dev.shell.embed_forward(ids, mask, pos)
            grads = torch.autograd.grad(hidden.to(self.dtype), params, gout, allow_unused=True)
            self._accumulate(dev, 0, None, list(grads))
            del hidden, grads, gout
        ctx.grads[0].free()
        ctx.acts[0].free()
