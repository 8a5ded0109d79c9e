"""Preallocated device memory for one device entry.

Layer slots (compute dtype) and gradient accumulators (fp32) are allocated once and reused for
every layer, so device memory does not grow with depth and the allocator never churns. The
embedding and head have dedicated resident buffers. A small fp32 staging buffer lets fp32
master weights be uploaded and cast on the device (bf16 mode) without a host-side cast.
"""

from __future__ import annotations

import torch

from tinypipe.devices.backend import Backend


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
    ) -> None:
        """``grad_numel`` / ``resident_grad``: gradient accumulator sizes when they differ from the
        parameter sizes (only trainable parameters have gradients; default: the same sizes)."""
        dev = backend.device
        self.backend = backend
        self.dtype = dtype
        self.slots = [torch.empty(slot_numel, dtype=dtype, device=dev) for _ in range(num_slots)]
        grad_numel = slot_numel if grad_numel is None else grad_numel
        resident_grad = resident if resident_grad is None else resident_grad
        self.grad_slots = [torch.empty(grad_numel, dtype=torch.float32, device=dev)
                           for _ in range(num_grad_slots)]
        self.resident = {layer: torch.empty(n, dtype=dtype, device=dev) for layer, n in resident.items()}
        self.resident_grads = {layer: torch.empty(n, dtype=torch.float32, device=dev)
                               for layer, n in resident_grad.items()}
        need_staging = backend.is_cuda and dtype != torch.float32
        self.staging = torch.empty(staging_numel, dtype=torch.float32, device=dev) if need_staging else None

    def bytes_by_category(self) -> dict[str, int]:
        def size(ts: list[torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        return {
            "resident_layers": size(list(self.resident.values())),
            "layer_slots": size(self.slots),
            "gradient_accumulators": size(self.grad_slots) + size(list(self.resident_grads.values())),
            "staging": size([self.staging] if self.staging is not None else []),
        }

    def params(self, layer: int, slot: int | None) -> torch.Tensor:
        return self.resident[layer] if slot is None else self.slots[slot]

    def grads(self, layer: int, slot: int | None) -> torch.Tensor:
        return self.resident_grads[layer] if slot is None else self.grad_slots[slot]
