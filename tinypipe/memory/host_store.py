"""The single host copy of training state: fp32 master weights and AdamW moments, per layer.

Each layer owns one contiguous fp32 buffer holding all of its parameters (aligned offsets from
the decomposition's layout), so a layer uploads with one copy and steps with one fused AdamW
call. The Hugging Face model's parameters are re-pointed at views of these buffers: the model
object and the engine share one copy, and ``model.state_dict()`` always shows the master weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tinypipe.devices.backend import HostPinner
from tinypipe.memory.host_buffers import aligned_empty, registrable
from tinypipe.models.decompose import Decomposition, LayerSpec


@dataclass
class LayerState:
    """Master weights and optimizer moments of one layer (flat fp32)."""

    spec: LayerSpec
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0

    def view(self, name: str) -> torch.Tensor:
        for p in self.spec.params:
            if p.name == name:
                return self.master[p.offset : p.offset + p.numel].view(p.shape)
        raise KeyError(name)


class HostStore:
    """One fp32 master + AdamW state per layer; the model's parameters become views into it."""

    def __init__(self, model: nn.Module, decomposition: Decomposition, pinner: HostPinner) -> None:
        self.decomposition = decomposition
        self.pinner = pinner
        named = dict(model.named_parameters())
        self.layers: list[LayerState] = []
        for spec in decomposition.layers:
            master = aligned_empty(spec.numel, torch.float32)
            with torch.no_grad():
                end = 0
                for p in spec.params:  # zero only the alignment gaps: the copies fill the rest
                    master[end : p.offset].zero_()
                    end = p.offset + p.numel
                master[end:].zero_()
                for p in spec.params:
                    param = named[p.name]
                    view = master[p.offset : p.offset + p.numel].view(p.shape)
                    view.copy_(param.detach())
                    param.data = view  # the model now reads the master copy; its old storage is freed
            pinner.pin(registrable(master))
            state = LayerState(
                spec=spec,
                master=master,
                # uninitialised until the first step zeroes them chunk by chunk, overlapped with
                # backward (first-touching tens of GB here would stall start-up)
                exp_avg=torch.empty(spec.numel, dtype=torch.float32),
                exp_avg_sq=torch.empty(spec.numel, dtype=torch.float32),
            )
            self.layers.append(state)

    @property
    def master_bytes(self) -> int:
        return sum(s.master.numel() * 4 for s in self.layers)

    @property
    def optimizer_bytes(self) -> int:
        return sum((s.exp_avg.numel() + s.exp_avg_sq.numel()) * 4 for s in self.layers)

    @property
    def param_count(self) -> int:
        return sum(s.spec.param_count for s in self.layers)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights under the model's own keys (tied aliases included; live views)."""
        out: dict[str, torch.Tensor] = {}
        for s in self.layers:
            for p in s.spec.params:
                view = s.master[p.offset : p.offset + p.numel].view(p.shape)
                for alias in self.decomposition.aliases[p.name]:
                    out[alias] = view
        return out
