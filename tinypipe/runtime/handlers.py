"""What each task kind does on its device: uploads, the three model stages, gradient downloads and
the host update (handed to the optimizer path). One :class:`TaskHandlers` per step, given the
step's :class:`~tinypipe.runtime.context.StepContext` and the engine's
:class:`~tinypipe.runtime.resources.EngineResources`; the handlers themselves live by job in
:mod:`~tinypipe.runtime.compute_handlers` (forward, head, backward),
:mod:`~tinypipe.runtime.transfer_handlers` (upload, reduce, download) and
:mod:`~tinypipe.runtime.update_handlers` (the host update), on the shared
:mod:`~tinypipe.runtime.handler_base`."""

from __future__ import annotations

from typing import Callable

from tinypipe.runtime.compute_handlers import ComputeHandlers
from tinypipe.runtime.context import StepContext
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.resources import EngineResources
from tinypipe.runtime.transfer_handlers import TransferHandlers
from tinypipe.runtime.update_handlers import UpdateHandlers
from tinypipe.schedule.ids import Kind
from tinypipe.schedule.tasks import COMPUTE_KINDS, Task


class TaskHandlers(ComputeHandlers, TransferHandlers, UpdateHandlers):
    """One step's task handlers: each task kind to its handler, run under the compute generator."""

    def __init__(self, res: EngineResources, ctx: StepContext) -> None:
        super().__init__(res, ctx)
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
