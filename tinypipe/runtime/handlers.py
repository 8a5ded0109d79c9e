"""What each task kind does on its device: uploads, the three model stages, downloads and the
CPU optimizer update. Mixed into :class:`~tinypipe.runtime.step.StepRunner`, whose state
(schedule, inputs, buffers, signals) these handlers use."""

from __future__ import annotations

import queue

import torch

from tinypipe.errors import NonFiniteError
from tinypipe.models.decompose import LayerSpec, map_tensors, slice_rows
from tinypipe.models.head import autograd_head_chunk, fused_head_chunk, is_plain_linear
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.signals import POLL_S
from tinypipe.schedule.tasks import Task


NORM_CHUNK = 1 << 24  # elements per partial gradient norm


class TaskHandlers:
    """Task handlers and the binding/accumulation helpers they share."""

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

    def _bind_borrowed(self, dev: DeviceRuntime, layer: int, grad: bool) -> list[tuple[torch.Tensor, int, int, int]]:
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

    def _accumulate(self, dev: DeviceRuntime, layer: int, slot: int | None, grads: list[torch.Tensor | None]) -> None:
        acc = dev.pool.grads(layer, slot)
        for p, g in zip(self._spec(layer).trainable_params, grads):
            if g is not None:
                acc[p.offset : p.offset + p.numel].view(p.shape).add_(g)

    def _zero_grads(self, dev: DeviceRuntime, layer: int, slot: int | None) -> None:
        dev.pool.grads(layer, slot)[: self._spec(layer).train_numel].zero_()

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

    def _upload(self, task: Task, dev: DeviceRuntime) -> None:
        layer = task.layers[0]
        self.deferred.wait_layer(layer, self.abort)  # the last step's clipped update of this layer
        src = self.store.layers[layer].master
        dst = dev.pool.params(layer, task.slots[0] if task.slots else None)
        # stepped on the device: loaded (master and moments) once, resident from then on
        on_device = dev.optim is not None and dev.optim.owns(layer)
        if on_device and not dev.optim.load(layer, dst):
            return
        staging = dev.pool.staging
        n = src.numel()
        frozen = self.store.layers[layer].frozen
        if frozen is not None:  # already at the compute precision: one plain copy after the prefix
            dst[n : n + frozen.numel()].copy_(frozen, non_blocking=True)
        if on_device:
            return
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
            wtrain = wslice.trainable
            wacc = None  # a frozen output embedding (LoRA) gets no weight gradient
            if wtrain:
                wacc = dev.pool.grads(owner, None)[wslice.offset : wslice.offset + wslice.numel].view(wslice.shape)
            post = [(p, t) for p, t in zip(spec.trainable_params, own) if p.name != wname]
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
                                                       post_params, wacc, weight_grad=wtrain)
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
        if not self._spec(0).train_numel:  # frozen embedding (LoRA): nothing to differentiate
            self.state.grads[0].free()
            self.state.acts[0].free()
            return
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
        n = self._spec(layer).train_numel
        acc = dev.pool.grads(layer, task.grad_slots[0] if task.grad_slots else None)[:n]
        q = self.state.layer_queues[layer]
        on_device = dev.optim is not None and dev.optim.owns(layer)
        # the retained buffer (clipping / skip) is created here, before the norm tells the update
        # task to look for it: created by both lanes at once, the chunks would land in the other one
        keep = None if on_device else self.updater.retain_buffer(layer)
        # fp32 norms of in-place chunks, combined in fp64: no full-size copy on the device (an fp64
        # reduction materialised an 8 B/element copy -- 3 GB of a 3B model's peak)
        norms = [torch.linalg.vector_norm(acc[lo : lo + NORM_CHUNK]) for lo in range(0, n, NORM_CHUNK)] or [acc.sum()]
        norm = torch.linalg.vector_norm(torch.stack(norms).double())
        q.put(("norm", norm, dev.backend.record_event(dev.streams["d2h"]), dev))
        if on_device:  # stepped where it is: only the norm leaves the device
            q.put(("end", None, None, dev))
            return
        pool = dev.grad_pool
        for lo in range(0, n, pool.chunk):
            hi = min(n, lo + pool.chunk)
            if keep is not None:
                keep[lo:hi].copy_(acc[lo:hi], non_blocking=True)
                buf = None
            else:
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
        keep = self.updater.retain_buffer(layer) if decision != "device" else None  # holds the chunks already
        step_no = state.step + 1
        while True:
            kind, payload, event, src = self._get(q)
            if kind == "end":
                break
            lo, hi, buf = payload
            src.backend.sync_event(event)
            grad = keep[lo:hi] if buf is None else buf[: hi - lo]
            if decision == "step":
                self.updater.optimizer.step(state, lo, hi, grad, step_no, self.updater.lr)
            if buf is not None:
                src.grad_pool.release(buf)
        if decision == "step":
            state.step = step_no
