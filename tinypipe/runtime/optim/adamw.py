"""AdamW over slices of flat layer buffers (host or device), chunk by chunk, plus its exact inverse.

The step is torch's own fused AdamW (``torch.optim.adamw.adamw(fused=True)``), applied to
slices of a layer's flat master/moment buffers: AdamW is elementwise, so stepping a layer in
chunks as its gradient chunks arrive equals stepping it whole.

Weight decay follows :class:`~tinypipe.runtime.optim.decay.DecayGroups` (HF Trainer's rule: no
decay on biases and normalization weights). A chunk that mixes both kinds is stepped with two
fused calls -- the decayed runs as one tensor list, the others as another with
``weight_decay=0`` -- so a layer steps in at most two calls per chunk, and in one (as before)
when it has no such run or ``weight_decay`` is 0.

The inverse exists for exact global-norm clipping with overlap: a layer is stepped as soon as
its gradients arrive (speculating that clipping will not trigger); if the global norm turns out
to exceed ``max_grad_norm``, each speculative step is undone algebraically (in place, from the
retained gradient) and redone with the clipped gradient.
"""

from __future__ import annotations

import torch
import torch.optim.adamw as _adamw

from tinypipe.memory.host_store import LayerState
from tinypipe.runtime.optim.decay import DecayGroups


class ChunkedAdamW:
    """Hyper-parameters plus chunked step / undo over :class:`LayerState` buffers: the host store's
    (as gradient chunks arrive) and the device copies of
    :class:`~tinypipe.runtime.optim.device_state.DeviceOptimizerState` alike."""

    def __init__(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 groups: DecayGroups | None = None) -> None:
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.groups = groups or DecayGroups()  # default: every parameter decayed

    def _pieces(self, state: LayerState, lo: int, hi: int) -> list[tuple[int, int, bool]]:
        if not self.weight_decay or not self.groups.no_decay:  # the common case: one run
            return [(lo, hi, True)]
        # a sharded rank's state holds one slice of the layer: its offsets start at the slice's
        # ``base`` (runtime/optim/sharded.py), the decay groups' at the layer's first element
        base = getattr(state, "base", 0)
        pieces = self.groups.pieces(state.spec.index, lo + base, hi + base)
        return [(a - base, b - base, d) for a, b, d in pieces]

    def step(self, state: LayerState, lo: int, hi: int, grad: torch.Tensor, step: int, lr: float,
             grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
        """AdamW step number ``step`` (1-based) on elements ``lo:hi`` of ``state``; ``grad_scale``
        (a one-element fp32 tensor on the buffers' device): the kernel divides the gradient by it
        and writes the quotient back into ``grad`` in the same pass (clipping without a pass of
        its own, :meth:`StepDecisions._redo`). ``found_inf`` (the same kind of tensor): when it
        holds 1 the kernel leaves weights and moments as they are -- a device that steps before
        the host has seen the norm skips a non-finite gradient by itself."""
        if step == 1:  # moments start at zero; they were left uninitialised at allocation
            state.exp_avg[lo:hi].zero_()
            state.exp_avg_sq[lo:hi].zero_()
        pieces = self._pieces(state, lo, hi)
        for decayed in (True, False):
            runs = [(a, b) for a, b, d in pieces if d == decayed]
            if runs:
                decay = self.weight_decay if decayed else 0.0
                self._fused(state, runs, lo, grad, step, lr, decay, grad_scale, found_inf)

    def _fused(self, state: LayerState, runs: list[tuple[int, int]], lo: int, grad: torch.Tensor,
               step: int, lr: float, weight_decay: float, grad_scale: torch.Tensor | None,
               found_inf: torch.Tensor | None = None) -> None:
        """One fused AdamW call over the element ranges ``runs`` (``grad`` starts at ``lo``)."""
        # the step count as a tensor on the buffers' device (fused CUDA wants it there), one per
        # tensor; made by a fill kernel: ``torch.tensor(x, device=cuda)`` copies from pageable
        # memory, which blocks this thread until everything queued before on the stream is done
        # -- an assisted round trip then stalls at every chunk (bench/archive/assist_roundtrip.py)
        dev = state.master.device
        steps = [torch.full((), float(step - 1), dtype=torch.float32, device=dev) for _ in runs]
        _adamw.adamw(
            [state.master[a:b] for a, b in runs],
            [grad[a - lo : b - lo] for a, b in runs],
            [state.exp_avg[a:b] for a, b in runs],
            [state.exp_avg_sq[a:b] for a, b in runs],
            [],
            steps,
            fused=True,
            grad_scale=grad_scale,
            found_inf=found_inf,
            amsgrad=False,
            beta1=self.beta1,
            beta2=self.beta2,
            lr=lr,
            weight_decay=weight_decay,
            eps=self.eps,
            maximize=False,
        )

    def undo(self, state: LayerState, lo: int, hi: int, grad: torch.Tensor, step: int, lr: float) -> None:
        """Invert :meth:`step` number ``step`` on ``lo:hi`` given the gradient it used.

        In place in fp32 with one temporary: the float64 version materialised a dozen full-size
        temporaries and ran ~40x slower than the step (a 3B model's rollback took ~50 s). The
        stored moments are fp32 already, so fp64 arithmetic bought no accuracy that survives.
        """
        b1, b2 = self.beta1, self.beta2
        p = state.master[lo:hi]
        m = state.exp_avg[lo:hi]
        v = state.exp_avg_sq[lo:hi]
        bc1 = 1.0 - b1**step
        bc2 = 1.0 - b2**step
        denom = v.sqrt().div_(bc2**0.5).add_(self.eps)
        p.addcdiv_(m, denom, value=lr / bc1)
        if self.weight_decay:
            for a, b, decayed in self._pieces(state, lo, hi):
                if decayed:
                    state.master[a:b].div_(1.0 - lr * self.weight_decay)
        del denom
        if step == 1:
            m.zero_()
            v.zero_()
        else:
            m.sub_(grad, alpha=1.0 - b1).div_(b1)
            v.addcmul_(grad, grad, value=-(1.0 - b2)).div_(b2).clamp_(min=0.0)
