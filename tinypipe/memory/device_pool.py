"""Preallocated device memory for one device entry.

Layer slots (compute dtype) and gradient accumulators (fp32) are allocated once and reused for
every layer, so device memory does not grow with depth and the allocator never churns. The
embedding and head have dedicated resident buffers. A small fp32 staging buffer lets fp32
master weights be uploaded and cast on the device (bf16 mode) without a host-side cast.
"""

from __future__ import annotations

import torch

from tinypipe.devices.backend import Backend

#: Elements per chunk of an assisted clipped update (runtime/optim/assist.py): that many elements of
#: a layer's fp32 master, both moments and its gradient go up, are stepped and come back at once.
ASSIST_CHUNK_NUMEL = 1 << 22
#: Chunk buffers of assisted updates per device: one uploading, one being stepped, one downloading.
ASSIST_BUFFERS = 3


def assist_scratch_numel(assisted: bool) -> int:
    """fp32 elements of assisted-update scratch one device holds (0 when no layer is assisted):
    master, two moments and gradient for each of :data:`ASSIST_BUFFERS` chunks."""
    return 4 * ASSIST_CHUNK_NUMEL * ASSIST_BUFFERS if assisted else 0


class DevicePool:
    """Fixed buffers on one device: slots, gradient accumulators, residents, staging."""

    def __init__(
        self,
        backend: Backend,
        dtype: torch.dtype,
        slot_numel: int,
        num_slots: int,
        num_grad_slots: int,
        resident: dict[int, int],
        staging_numel: int,
        grad_numel: int | None = None,
        resident_grad: dict[int, int] | None = None,
        assist: bool = False,
        transient_grads: frozenset[int] = frozenset(),
        transient_weights: frozenset[int] = frozenset(),
    ) -> None:
        """``grad_numel`` / ``resident_grad``: gradient accumulator sizes when they differ from the
        parameter sizes (only trainable parameters have gradients; default: the same sizes).
        ``assist``: hold the scratch of assisted clipped updates (:func:`assist_scratch_numel`).
        ``transient_grads``: resident layers whose gradient accumulator is allocated at its first
        use in a step and freed by :meth:`release_grads` after its download, not held
        (:mod:`tinypipe.schedule.transient_grads`). ``transient_weights``: frozen resident layers
        whose weight buffer is allocated by its step's upload and freed by :meth:`release_params`
        after its last reader (same module)."""
        dev = backend.device
        self.backend = backend
        self.dtype = dtype
        self.slots = [torch.empty(slot_numel, dtype=dtype, device=dev) for _ in range(num_slots)]
        grad_numel = slot_numel if grad_numel is None else grad_numel
        resident_grad = resident if resident_grad is None else resident_grad
        self.grad_slots = [torch.empty(grad_numel, dtype=torch.float32, device=dev)
                           for _ in range(num_grad_slots)]
        self._numels = dict(resident)
        self.transient_weights = frozenset(transient_weights) & set(resident)
        self.resident = {layer: torch.empty(n, dtype=dtype, device=dev) for layer, n in resident.items()
                         if layer not in self.transient_weights}
        self._grad_numels = dict(resident_grad)
        self.transient_grads = frozenset(transient_grads) & set(resident_grad)
        self.resident_grads = {layer: torch.empty(n, dtype=torch.float32, device=dev)
                               for layer, n in resident_grad.items() if layer not in self.transient_grads}
        need_staging = backend.is_cuda and dtype != torch.float32
        self.staging = torch.empty(staging_numel, dtype=torch.float32, device=dev) if need_staging else None
        # per chunk buffer: master, exp_avg, exp_avg_sq, gradient, ASSIST_CHUNK_NUMEL each
        self.assist = [torch.empty(4, ASSIST_CHUNK_NUMEL, dtype=torch.float32, device=dev)
                       for _ in range(ASSIST_BUFFERS if assist else 0)]

    def bytes_by_category(self) -> dict[str, int]:
        def size(ts: list[torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        held = [g for layer, g in self.resident_grads.items() if layer not in self.transient_grads]
        cats = {
            "resident_layers": size([t for layer, t in self.resident.items()
                                     if layer not in self.transient_weights]),
            "layer_slots": size(self.slots),
            # a transient accumulator is a phase's working memory (the activation peak counts it)
            "gradient_accumulators": size(self.grad_slots) + size(held),
            "staging": size([self.staging] if self.staging is not None else []),
        }
        if self.assist:  # only where updates are assisted (as the planner's estimate lists it)
            cats["assist_scratch"] = size(self.assist)
        return cats

    def params(self, layer: int, slot: int | None) -> torch.Tensor:
        """``layer``'s weight buffer (its ``slot``, or its own resident one; a transient one is
        allocated here when its step's upload asks for it)."""
        if slot is not None:
            return self.slots[slot]
        return self._held(self.resident, layer, self.transient_weights, self._numels, self.dtype)

    def params_alive(self, layer: int) -> bool:
        """Whether ``layer``'s own weight buffer exists now (a transient one lives between its
        upload and its release)."""
        return layer in self.resident

    def release_params(self, layer: int) -> None:
        """Free a transient weight buffer (the kernels reading it must have completed, and nothing
        may still point at it: the caching allocator hands its memory to the next allocation)."""
        if layer in self.transient_weights:
            self.resident.pop(layer, None)

    def grads(self, layer: int, slot: int | None) -> torch.Tensor:
        """``layer``'s gradient accumulator (its ``slot``'s, or its own resident one; a transient
        one is allocated here when its step's first writer asks for it -- and zeroed by it)."""
        if slot is not None:
            return self.grad_slots[slot]
        return self._held(self.resident_grads, layer, self.transient_grads, self._grad_numels, torch.float32)

    def _held(self, held: dict[int, torch.Tensor], layer: int, transient: frozenset[int],
              numels: dict[int, int], dtype: torch.dtype) -> torch.Tensor:
        """A resident buffer of ``held``, allocated first if it is a transient one not yet alive."""
        if layer not in held and layer in transient:
            held[layer] = torch.empty(numels[layer], dtype=dtype, device=self.backend.device)
        return held[layer]

    def release_grads(self, layer: int) -> None:
        """Free a transient accumulator (its download's copies must have completed: the caching
        allocator hands its memory to the next allocation of the stream it was made on, without
        waiting for other streams' reads)."""
        if layer in self.transient_grads:
            self.resident_grads.pop(layer, None)
