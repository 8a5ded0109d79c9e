"""Saved weights by reference: a kept pack's graph outlives the buffers its forward read.

A pack that keeps its activations (``Plan.keep_activations``) records its forward's autograd graph
and differentiates it in its backward. What autograd saves of the *weights* (a linear's weight for
the input gradient, a transposed view of it under torch.compile) points into the pack's device
slots, and a streamed pack's slots are refilled with other layers between its forward and its
backward; the backward re-uploads the same weights into other slots. :class:`WeightRefs` is a
pair of ``saved_tensors_hooks``: a saved tensor that lies inside one of the pack's weight buffers
is stored as its place in that buffer (layer, element offset, shape, strides), and when the
backward unpacks it, it is read from that layer's buffer *then* -- the same values (the layer is
not updated between its forward and its backward: the validator proves it), no copy, no device
memory held. Activations are saved as they are.

A saved tensor may *reinterpret* the buffer's bytes: a QLoRA layer's buffer holds bitsandbytes'
payload (packed 4-bit codes as uint8, fp32 scales, tinypipe.quant.layout) viewed as the compute
dtype, and a compiled block's graph saves those parts for its backward. The payload is frozen and
uploaded byte for byte, so such a view is referenced like any other -- by its *byte* offset and
its dtype -- and the backward reads the same bytes from its own buffer.

Checked on CPU (a Llama block, fp32, eager and Inductor): gradients through a graph whose forward
slot was overwritten with NaN and whose weights were re-read from a second buffer equal plain
autograd's exactly; in the engine, streamed packs whose backward runs in other slots match
PyTorch, and without the references they do not (tests/test_keep_activations.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch


@dataclass(frozen=True)
class _Ref:
    """Where a saved tensor sits in a layer's flat weight buffer."""

    layer: int
    offset: int  # bytes from the buffer's first byte
    dtype: torch.dtype  # the saved view's (a quantized payload's parts differ from the buffer's)
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def span(self) -> int:
        """Bytes from the view's first element to the end of its last."""
        if any(n == 0 for n in self.size):
            return 0
        last = sum((n - 1) * st for n, st in zip(self.size, self.stride))
        return (last + 1) * torch.empty((), dtype=self.dtype).element_size()


class WeightRefs:
    """Saved-tensor hooks mapping views of a pack's weight buffers to references (see module doc).

    ``buffers``: layer -> its flat device buffer in the forward. :meth:`rebind` points the
    references at the backward's buffers before the graph is differentiated. ``sink`` /
    ``restore``: where the other saved tensors go and come back from (a kept graph in host
    memory, runtime/host_kept.py); without them they stay as they are.
    """

    def __init__(self, buffers: Mapping[int, torch.Tensor],
                 sink: Callable[[torch.Tensor], object] | None = None,
                 restore: Callable[[object], torch.Tensor] | None = None) -> None:
        self._forward = dict(buffers)
        self._current = dict(buffers)
        self._sink = sink
        self._restore = restore

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Record a forward under these hooks (thread-local: enter it in the computing thread)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def rebind(self, buffers: Mapping[int, torch.Tensor]) -> None:
        """The layers' buffers in the backward (the same weights, maybe in other slots)."""
        missing = set(self._forward) - set(buffers)
        if missing:
            raise RuntimeError(f"kept graph: no backward buffer for layers {sorted(missing)}")
        self._current = dict(buffers)

    def _pack(self, t: torch.Tensor) -> object:
        ptr = t.data_ptr()
        for layer, buf in self._forward.items():
            start = buf.data_ptr()
            if t.device != buf.device or not start <= ptr < start + buf.numel() * buf.element_size():
                continue
            return _Ref(layer, ptr - start, t.dtype, tuple(t.shape), tuple(t.stride()))
        return t if self._sink is None else self._sink(t)

    def _unpack(self, saved: object) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        if not isinstance(saved, _Ref):
            assert self._restore is not None, "a saved tensor sunk without a way back"
            return self._restore(saved)
        buf = self._current[saved.layer]
        raw = buf.reshape(-1).view(torch.uint8)[saved.offset : saved.offset + saved.span]
        view = raw.view(saved.dtype)  # the same bytes as the forward's view, from this buffer
        return torch.as_strided(view, saved.size, saved.stride, view.storage_offset())
