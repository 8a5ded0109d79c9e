"""AdamW state kept on the device for resident layers (embedding, head, resident packs): their
updates never cross the link.

Resident layers stay on their device for the whole step anyway. Stepping them on the host
costs, every step, an upload of their weights at the start, a download of their fp32 gradients,
and a host AdamW pass -- and the embedding's gradient is the last one the backward produces, so
that pass is exposed after the backward (measured ~0.2 s of a 1.96 s Llama-3.2-3B step on an
H200: 394 M tied parameters). Keeping their fp32 master and moments on the device (12 bytes per
parameter of device memory) turns that into a few milliseconds of device AdamW after the step.
The planner spends spare device memory on it (``Config.device_optimizer``, ``resident_packs``).

The host copy (master, moments) is the checkpointed one: :meth:`DeviceOptimizerState.store`
brings it up to date (``Engine.synchronize``); :meth:`DeviceOptimizerState.invalidate` makes the
next step reload the device state from it (after ``load_checkpoint``). The step is the same
fused AdamW the host uses (:class:`~tinypipe.runtime.optim.adamw.ChunkedAdamW`), with the same
clipping coefficient, applied once the step's global norm is known.
"""

from __future__ import annotations

import torch

from tinypipe.devices.backend import Backend
from tinypipe.memory.device_pool import DevicePool
from tinypipe.memory.host_store import LayerState
from tinypipe.runtime.optim.adamw import ChunkedAdamW


class DeviceOptimizerState:
    """fp32 master weights and AdamW moments of some resident layers, on one device, and their
    step (queued on ``stream``, the device's compute stream: the next step's kernels follow it)."""

    def __init__(self, backend: Backend, stream: object, pool: DevicePool,
                 host_layers: dict[int, LayerState]) -> None:
        self.backend = backend
        self.stream = stream
        self.pool = pool  # the resident compute copies (weights) and gradient accumulators
        dev = backend.device
        self.states = {
            layer: LayerState(
                s.spec,
                master=torch.empty(s.spec.train_numel, dtype=torch.float32, device=dev),
                exp_avg=torch.empty(s.spec.train_numel, dtype=torch.float32, device=dev),
                exp_avg_sq=torch.empty(s.spec.train_numel, dtype=torch.float32, device=dev),
            )
            for layer, s in host_layers.items()
            if s.spec.train_numel
        }
        self.host = host_layers
        self.loaded: set[int] = set()  # device state current for these layers
        self.host_current = True  # host copies equal the device state

    @property
    def nbytes(self) -> int:
        return sum(3 * 4 * s.spec.train_numel for s in self.states.values())

    def owns(self, layer: int) -> bool:
        return layer in self.states

    def load(self, layer: int, params: torch.Tensor) -> bool:
        """Copy the host state of ``layer`` to the device (on the current stream) unless already
        there; either way ``params`` (the resident compute copy) must hold the master weights.
        Returns whether anything was copied."""
        if layer in self.loaded:
            return False
        host, dev = self.host[layer], self.states[layer]
        dev.master.copy_(host.master, non_blocking=True)
        if host.step > 0:  # moments of a layer never stepped are undefined on the host
            dev.exp_avg.copy_(host.exp_avg, non_blocking=True)
            dev.exp_avg_sq.copy_(host.exp_avg_sq, non_blocking=True)
        params[: dev.master.numel()].copy_(dev.master)
        self.loaded.add(layer)
        return True

    def step(self, layer: int, adamw: ChunkedAdamW, coef: float, step: int, lr: float) -> None:
        """AdamW step ``step`` of ``layer`` with its accumulated gradient times ``coef``; refresh
        its compute copy."""
        with self.backend.use_stream(self.stream):
            grad, params = self.pool.grads(layer, None), self.pool.params(layer, None)
            dev = self.states[layer]
            n = dev.master.numel()
            # the clip coefficient as the kernel's grad_scale, as the host's deferred steps take it
            # (StepDecisions._redo): a layer stepped here and on the host get the same bits; the
            # kernel writes the scaled gradient back, and the accumulator is zeroed before reuse
            scale = None
            if coef != 1.0:
                scale = torch.full((), 1.0 / coef, dtype=torch.float32, device=grad.device)
            adamw.step(dev, 0, n, grad[:n], step, lr, grad_scale=scale)
            params[:n].copy_(dev.master)
        self.host_current = False

    def store(self) -> None:
        """Bring the host copies (master weights, moments) up to date; blocks until done."""
        if self.host_current:
            return
        self.backend.synchronize()  # the updates were queued on the compute stream
        for layer, dev in self.states.items():
            host = self.host[layer]
            host.master.copy_(dev.master, non_blocking=True)
            host.exp_avg.copy_(dev.exp_avg, non_blocking=True)
            host.exp_avg_sq.copy_(dev.exp_avg_sq, non_blocking=True)
        self.backend.synchronize()
        self.host_current = True

    def invalidate(self) -> None:
        """The host copy changed (a checkpoint was loaded): reload the device state next step."""
        self.loaded.clear()
        self.host_current = True
