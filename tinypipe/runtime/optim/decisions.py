"""Per-step optimizer decisions on the host: speculative steps, exact clipping, non-finite checks.

Layers are stepped the moment their gradients arrive, speculating that global-norm clipping
will not trigger. Each layer's squared gradient norm arrives first (computed on the device), so
once the running norm already exceeds ``max_grad_norm`` the remaining layers are deferred rather
than stepped. At the end of the step the true global norm is known: if clipping applies, every
speculative step is undone exactly (from the retained gradient) and redone with the clipped
gradient, and deferred layers are stepped with it. When clipping does not apply -- the common
case -- nothing is redone and all optimizer work overlapped the backward pass.

A rollback costs more than deferring (undo + redo vs one step), so speculation follows the last
step: after a clipped step the next one defers every layer to the end (one optimizer pass after
the backward instead of two); after an unclipped step it speculates again. Under
``nonfinite="skip"`` nothing is speculated: undoing a step is exact only to float rounding, and a
skipped step must leave the state bit-identical.

Leftover work (deferred layers, redone ones) is left by :meth:`StepDecisions.finalize` in
``work`` and runs while the next step starts (:mod:`tinypipe.runtime.optim.background`). The
plan's deferred layers (``Plan.deferred``) are deferred in every step, clipped or not: their
update runs there, in the host's idle forward, before their upload.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from tinypipe.memory.host_store import HostStore, LayerState
from tinypipe.runtime.optim.adamw import ChunkedAdamW

_NO_GRAD = torch.empty(0)
REDO_CHUNK = 1 << 22  # 16 MiB of fp32 gradient: undone, then stepped while in cache

#: What happens to a layer's gradient as it arrives: stepped at once (speculating that clipping
#: will not trigger), deferred to the end of the step, skipped (non-finite), or left to its device.
Decision = Literal["step", "defer", "skip", "device"]


@dataclass
class StepOutcome:
    """What one step's optimizer work decided, once its global gradient norm was known."""

    grad_norm: float
    clipped: bool
    skipped: bool
    nonfinite: str | None
    clip_coef: float = 1.0
    #: (layer, start, end) of the previous step's leftover updates that ran during this step
    background_timings: list[tuple[int, float, float]] = field(default_factory=list)
    #: a non-finite step's layers that were already stepped and could not be rolled back (no
    #: retained gradients to undo them from): they keep the step's update
    not_rolled_back: list[int] = field(default_factory=list)


@dataclass
class StepDecisions:
    """Decisions and bookkeeping for one optimizer step (made by
    :class:`~tinypipe.runtime.optim.path.OptimizerPath`, one per step)."""

    store: HostStore
    adamw: ChunkedAdamW
    lr: float
    max_grad_norm: float | None
    retained: dict[int, torch.Tensor] | None  # layer -> fp32 gradient copy (None: not retaining)
    norms_sq: dict[int, float] = field(default_factory=dict)
    stepped: list[int] = field(default_factory=list)
    deferred: list[int] = field(default_factory=list)
    nonfinite: str | None = None
    speculate: bool = True  # step layers before the global norm is known (False: defer them all)
    device_layers: frozenset[int] = frozenset()  # stepped on their device (DeviceOptimizerState)
    upload_order: dict[int, int] = field(default_factory=dict)  # layer -> rank of its first upload
    work: list[tuple[int, Callable[[], None]]] = field(default_factory=list)  # set by finalize()
    # (layer, step number) for the devices, set by finalize()
    device_steps: list[tuple[int, int]] = field(default_factory=list)
    # deferred layer -> (clip coefficient, step number) of its plain leftover update, set by finalize()
    # (what an assisted update runs on the device instead, runtime/optim/assist.py)
    deferred_steps: dict[int, tuple[float, int]] = field(default_factory=dict)
    # Plan.deferred: stepped only after the step, in the background (their gradients: deferred_grads
    # when no gradient is retained for clipping)
    deferred_layers: frozenset[int] = frozenset()
    deferred_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    _on_device: list[int] = field(default_factory=list)
    #: layer -> (state, gradient) staged from the SSD around its leftover work (see SsdTier.background)
    staged: dict[int, tuple[LayerState, torch.Tensor | None]] = field(default_factory=dict)

    def decide(self, layer: int, norm_sq: float, loss_finite: bool = True) -> Decision:
        """'step', 'defer' or 'skip' for ``layer`` given its squared gradient norm."""
        self.norms_sq[layer] = norm_sq
        if self.nonfinite is None and not loss_finite:
            self.nonfinite = "loss"
        if self.nonfinite is None and not math.isfinite(norm_sq):
            self.nonfinite = f"gradients of {self.store.layers[layer].spec.name}"
        if self.nonfinite is not None:
            return "skip"
        if layer in self.device_layers:  # stepped after the step, on the device, once the norm is known
            self._on_device.append(layer)
            return "device"
        over = (self.max_grad_norm is not None
                and math.sqrt(sum(self.norms_sq.values())) + 1e-6 > self.max_grad_norm)
        if not self.speculate or over or layer in self.deferred_layers:
            self.deferred.append(layer)
            return "defer"
        self.stepped.append(layer)
        return "step"

    def finalize(self) -> StepOutcome:
        """Decide clipping / rollback for the completed step; the host optimizer work that
        follows from it is left in :attr:`work` (in the next step's upload order, for
        :class:`~tinypipe.runtime.optim.background.BackgroundUpdates`), the device steps in
        :attr:`device_steps`. Step counts are final when this returns."""
        total = math.sqrt(sum(self.norms_sq.values())) if self.norms_sq else 0.0
        self.work = []
        self.device_steps = []
        self.deferred_steps = {}
        if self.nonfinite is not None:
            if self.retained is not None:
                for layer in self.stepped:
                    state = self.store.layers[layer]
                    self.work.append((layer, functools.partial(self._undo, layer, state.step)))
                    state.step -= 1
            self.work.sort(key=lambda item: self._upload_rank(item[0]))
            kept = [] if self.retained is not None else list(self.stepped)
            return StepOutcome(total, False, True, self.nonfinite, not_rolled_back=kept)
        coef = 1.0
        if self.max_grad_norm is not None:
            coef = min(1.0, self.max_grad_norm / (total + 1e-6))
        clipped = coef < 1.0
        if clipped:
            for layer in self.stepped:
                step = self.store.layers[layer].step
                self.work.append((layer, functools.partial(self._redo, layer, coef, step, undo=True)))
        for layer in self._on_device:
            state = self.store.layers[layer]
            state.step += 1
            self.device_steps.append((layer, state.step))
        for layer in self.deferred:
            state = self.store.layers[layer]
            state.step += 1
            self.work.append((layer, functools.partial(self._redo, layer, coef, state.step, undo=False)))
            self.deferred_steps[layer] = (coef, state.step)
        self.work.sort(key=lambda item: self._upload_rank(item[0]))
        return StepOutcome(total, clipped, False, None, coef)

    def _upload_rank(self, layer: int) -> int:
        """Position of ``layer``'s first upload in the next step (``upload_order``; default: layer
        order). A device's uploads run one after the other, so work in any other order holds
        uploads back: sorted by layer while the head's upload came second, every block upload
        waited behind the head's update (measured on an H200: the forward started only after the
        whole 1.17 s pass)."""
        return self.upload_order.get(layer, layer) if self.upload_order else layer

    def _chunks(self, layer: int) -> list[tuple[int, int]]:
        """Optimizer chunks of ``layer`` (none for a frozen layer, which retains no gradient)."""
        n = self.store.layers[layer].spec.train_numel
        return [(lo, min(n, lo + REDO_CHUNK)) for lo in range(0, n, REDO_CHUNK)]

    def _views(self, layer: int) -> tuple[LayerState, torch.Tensor]:
        """``layer``'s state and retained gradient: staged from the SSD where they live there (a
        frozen layer retains none: its chunk list is empty)."""
        state, grad = self.staged.get(layer, (self.store.layers[layer], None))
        if grad is None:
            grads = self.retained if self.retained is not None else self.deferred_grads
            grad = grads.get(layer, _NO_GRAD)
        return state, grad

    def _undo(self, layer: int, step: int) -> None:
        """Roll back speculative step ``step`` of ``layer`` (a skipped, non-finite step)."""
        state, grad = self._views(layer)
        for lo, hi in self._chunks(layer):
            self.adamw.undo(state, lo, hi, grad[lo:hi], step, self.lr)

    def _redo(self, layer: int, coef: float, step: int, undo: bool) -> None:
        """Step ``layer`` with its gradient scaled by ``coef`` (after undoing the speculative step).

        Chunk by chunk (the undo's chunk is still in cache for the step). The clip coefficient goes
        into the fused kernel as ``grad_scale = 1 / coef`` (it divides the gradient as it reads
        it and writes the quotient back into the retained gradient, which the next step rewrites
        anyway): no separate ``g.mul_(coef)`` pass over the gradient. Dividing by the rounded
        reciprocal differs from multiplying by ``coef`` (torch's ``clip_grad_norm_``) by at most
        about one float32 rounding of the gradient; bench/archive/clip_bench.py times both.

        Without an undo the layer is stepped in one fused call, which the kernel parallelises over
        the whole layer: measured 13 % faster than in 16 MiB chunks on 16 cores
        (bench/archive/adamw_split_bench.py, docs/measured.md). Fewer calls also mean fewer GIL
        retakes for the background lane while the next step's lanes launch kernels."""
        state, grad = self._views(layer)
        scale = None
        if coef != 1.0:
            scale = torch.full((), 1.0 / coef, dtype=torch.float32, device=state.master.device)
        if not undo:  # one fused call for the whole layer (see the docstring)
            n = self.store.layers[layer].spec.train_numel  # as _chunks: 0 for a frozen layer
            if n:
                self.adamw.step(state, 0, n, grad[:n], step, self.lr, grad_scale=scale)
            return
        for lo, hi in self._chunks(layer):
            g = grad[lo:hi]
            self.adamw.undo(state, lo, hi, g, step, self.lr)
            self.adamw.step(state, lo, hi, g, step, self.lr, grad_scale=scale)
