"""Batch-major activation buffers that micro-batches are written into and read from.

Each pack boundary has one ``[batch, seq, hidden]`` buffer for activations (it doubles as the
stash the backward pass recomputes from) and one for gradients. A buffer lives on one device or
in host memory; writers and readers on other devices copy the rows they need, so forward and
backward may use different micro-batch sizes.
"""

from __future__ import annotations

import threading

import torch

from tinypipe.devices.backend import Backend


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` queued on the current stream(s); keeps cross-stream memory alive."""
    dst.copy_(src, non_blocking=True)
    if dst.device != src.device:
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor aliasing ``t``'s memory with its own autograd version counter.

    Views share their base's version counter, so a writer filling *other* rows of a buffer
    would make autograd reject a reader's saved rows; an alias built with ``set_`` does not.
    """
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    )


class RowBuffer:
    """A lazily allocated ``shape`` tensor on ``device`` (or a fixed host tensor)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, owner: Backend | None,
                 owner_stream: object = None, host: torch.Tensor | None = None) -> None:
        self.shape = shape
        self.dtype = dtype
        self.owner = owner
        self.owner_stream = owner_stream
        self.tensor: torch.Tensor | None = host
        self._ready: object | None = None
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return self.owner.device if self.owner is not None else torch.device("cpu")

    def _ensure(self) -> torch.Tensor:
        with self._lock:
            if self.tensor is None:
                assert self.owner is not None
                with self.owner.use_stream(self.owner_stream):
                    self.tensor = torch.empty(self.shape, dtype=self.dtype, device=self.owner.device)
                # the block may have been freed by kernels still queued on the owner's stream:
                # writers on other streams first wait for those (see write())
                self._ready = self.owner.record_event(self.owner_stream)
            return self.tensor

    def adopt(self, tensor: torch.Tensor) -> None:
        """Use ``tensor`` (already on the owner device, right shape) as the whole buffer."""
        with self._lock:
            self.tensor = tensor

    def write(self, lo: int, hi: int, src: torch.Tensor) -> None:
        dst = self._ensure()
        if self._ready is not None and src.is_cuda:
            torch.cuda.current_stream(src.device).wait_event(self._ready)  # type: ignore[arg-type]
            if dst.device != src.device:
                torch.cuda.current_stream(dst.device).wait_event(self._ready)  # type: ignore[arg-type]
        copy_into(dst[lo:hi], src)

    def read(self, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        """Rows ``lo:hi`` on ``device``: a view when already there, else a fresh copy."""
        t = self.tensor
        assert t is not None, "read of a buffer nothing has written"
        rows = t[lo:hi]
        if rows.device == device:
            return _alias(rows)
        out = torch.empty(rows.shape, dtype=rows.dtype, device=device)
        copy_into(out, rows)
        return out

    def free(self) -> None:
        """Drop a device buffer once its last reader is done (host buffers are kept for reuse)."""
        if self.owner is not None:
            with self._lock:
                self.tensor = None
