"""What every task handler of a step shares: the step's context and the engine's resources, the
compute generator each running compute task holds, and binding a layer's parameters to its device
buffers, accumulating its gradients and checking outputs. The handlers by job build on it
(:mod:`~tinypipe.runtime.compute_handlers`, :mod:`~tinypipe.runtime.transfer_handlers`,
:mod:`~tinypipe.runtime.update_handlers`); :class:`~tinypipe.runtime.handlers.TaskHandlers` joins them."""

from __future__ import annotations

import torch

from tinypipe.errors import NonFiniteError
from tinypipe.models.decompose import LayerSpec
from tinypipe.runtime.context import StepContext
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.resources import EngineResources
from tinypipe.runtime.rng import TaskRng
from tinypipe.schedule.tasks import Task


class HandlerBase:
    """The state and helpers of one step's task handlers."""

    def __init__(self, res: EngineResources, ctx: StepContext) -> None:
        self.res = res
        self.ctx = ctx
        self.store = res.store
        self.optim = res.optimizer
        self.dtype = res.compute_dtype
        self._rng: dict[int, TaskRng] = {}  # device entry -> its running compute task's generator hold

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
