"""The host update task of a step: a layer's gradient stream handed to the optimizer path; the
head's update first checks the step's loss (a non-finite one skips the step)."""

from __future__ import annotations

import torch

from tinypipe.runtime.handler_base import HandlerBase
from tinypipe.schedule.ids import head_id
from tinypipe.schedule.tasks import Task


class UpdateHandlers(HandlerBase):
    """The update tasks of one step."""

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
