"""Capture modules: stand-ins for the decoder blocks that record what the trunk passes to each.

The decomposition runs the trunk's own forward with its blocks replaced by these to learn the
model's structure (:class:`~tinypipe.models.decompose.Decomposition`); a device shell runs it the
same way to build each step's embedding output and block arguments
(:meth:`~tinypipe.models.shell.Shell.embed_forward`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Stop(Exception):
    """Raised by the last capture module to end the trunk's forward after the blocks' inputs."""


class Recorder:
    """Collects what the trunk passes to each block: the hidden states and the other arguments."""

    def __init__(self, count: int, stop: bool) -> None:
        self.count = count
        self.stop = stop
        self.hidden: torch.Tensor | None = None
        self.calls: list[tuple[tuple, dict] | None] = [None] * count
        self.order: list[str] = []


class Capture(nn.Module):
    """Stands in for block ``index``: records its call and returns the hidden states unchanged."""

    def __init__(self, recorder: Recorder, index: int, template: nn.Module) -> None:
        super().__init__()
        self._recorder = [recorder]  # list: keep it out of the module tree
        self.index = index
        for attr in ("attention_type", "layer_idx", "layer_type", "is_sliding"):
            if hasattr(template, attr) and not isinstance(getattr(template, attr), (nn.Module, torch.Tensor)):
                setattr(self, attr, getattr(template, attr))

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        rec = self._recorder[0]
        if args:
            hidden, rest = args[0], tuple(args[1:])
        else:
            kwargs = dict(kwargs)
            hidden, rest = kwargs.pop("hidden_states"), ()
        if self.index == 0:
            rec.hidden = hidden
        rec.calls[self.index] = (rest, dict(kwargs))
        rec.order.append(f"block{self.index}")
        if rec.stop and self.index == rec.count - 1:
            raise Stop()
        return hidden
