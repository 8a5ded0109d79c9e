"""The one interface behind which the CUDA-only parts live.

Streams, events, page-locked host memory and allocator statistics differ between CUDA and the
CPU. Everything else in tinypipe is device-agnostic and talks to a :class:`Backend`. On the CPU
the "device" is host memory: copies are synchronous in the calling thread, so an event is
complete as soon as it is recorded, and pinning is a no-op.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import warnings
import weakref
from typing import Callable, Iterator

import torch

from tinypipe.errors import ConfigError


class Backend:
    """Device-specific operations for one compute device."""

    device: torch.device
    is_cuda: bool = False

    def new_stream(self) -> object:
        raise NotImplementedError

    def use_stream(self, stream: object) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def record_event(self, stream: object, timing: bool = False) -> object | None:
        """Record an event on ``stream``; None where work is synchronous (CPU)."""
        return None

    def wait_event(self, stream: object, event: object | None) -> None:
        """Make ``stream`` wait for ``event`` without blocking the host."""

    def sync_event(self, event: object | None) -> None:
        """Block the host until ``event`` completes."""

    def synchronize(self) -> None:
        """Block the host until all work on the device completes."""

    def memory_stats(self) -> dict[str, int]:
        """Allocator counters: allocated, reserved and their peaks (bytes); empty on CPU."""
        return {}

    def reset_peak(self) -> None:
        """Reset the allocator's peak counters."""


class CpuBackend(Backend):
    """The CPU as a compute device: synchronous, nothing to pin, no allocator counters."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def new_stream(self) -> object:
        return None

    def use_stream(self, stream: object) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class CudaBackend(Backend):
    """A CUDA device: work is queued on streams and ordered with events."""

    is_cuda = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> object:
        return torch.cuda.Stream(device=self.device)

    def use_stream(self, stream: object) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)  # type: ignore[arg-type]

    def record_event(self, stream: object, timing: bool = False) -> object | None:
        # not blocking (``blocking=True`` lets a waiting lane sleep instead of spinning): blocking
        # events measured 2-3 % slower steps (docs/measured.md)
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream)  # type: ignore[arg-type]
        return event

    def wait_event(self, stream: object, event: object | None) -> None:
        if event is not None:
            stream.wait_event(event)  # type: ignore[attr-defined]

    def sync_event(self, event: object | None) -> None:
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def memory_stats(self) -> dict[str, int]:
        return {
            "allocated": torch.cuda.memory_allocated(self.device),
            "reserved": torch.cuda.memory_reserved(self.device),
            "peak_allocated": torch.cuda.max_memory_allocated(self.device),
            "peak_reserved": torch.cuda.max_memory_reserved(self.device),
        }

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def make_backend(name: str) -> Backend:
    """Backend for a device name such as ``"cpu"`` or ``"cuda:1"``; checks the device exists."""
    if name == "cpu":
        return CpuBackend()
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r}: CUDA is not available on this machine")
        device = torch.device(name)
        index = device.index if device.index is not None else torch.cuda.current_device()
        count = torch.cuda.device_count()
        if index >= count:
            raise ConfigError(f"device {name!r} does not exist: this machine has {count} CUDA device(s)")
        return CudaBackend(torch.device("cuda", index))
    raise ConfigError(f"unknown device {name!r}; use 'cpu' or 'cuda:N'")


_HOST_REGISTER_PORTABLE = 1  # pinned for every device's context, not just the current one


@functools.lru_cache(maxsize=1)
def _cuda_get_last_error() -> Callable[[], int] | None:
    """The CUDA runtime's ``cudaGetLastError`` of the library torch loaded (None: not found).
    torch binds cudaHostRegister/Unregister but not this; the runtime's error state is per
    library instance, so it is looked up in the process's own mappings."""
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    except OSError:
        pass
    for lib in [*paths, None]:  # None: the symbols the process has loaded globally
        try:
            return getattr(ctypes.CDLL(lib), "cudaGetLastError")
        except (OSError, AttributeError):
            continue
    return None


def clear_cuda_error() -> bool:
    """Reset this thread's CUDA last error after a runtime call that failed (returns whether it
    could). Why: a failed cudaHostRegister or cudaHostUnregister leaves the error set, and torch
    reports it at its next kernel launch as that kernel's own failure (e.g. an optimizer's
    ``zero_()`` raising "part or all of the requested memory range is already mapped") after the
    registration had fallen back to pageable memory as designed."""
    get_last_error = _cuda_get_last_error()
    if get_last_error is None:
        return False
    get_last_error()
    return True


def _unregister_all(registered: list[tuple[int, torch.Tensor]]) -> None:
    """Undo the registrations in ``registered`` (the tensors are alive until this returns)."""
    for ptr, _ in registered:
        err = torch.cuda.cudart().cudaHostUnregister(ptr)
        if getattr(err, "value", err) != 0:
            clear_cuda_error()
    registered.clear()


class HostPinner:
    """Page-locks host tensors in place with cudaHostRegister (no copy, no size rounding).

    ``tensor.pin_memory()`` copies into a new allocation rounded up to a power of two; for tens
    of GB of master weights that doubles host memory transiently and wastes up to half of it
    permanently. Registering the buffer we already own costs neither. Registration is undone by
    :meth:`release`, or when the pinner is garbage-collected (an engine never closed): memory
    freed while still registered leaves its address range registered, and the next buffer the
    allocator puts there fails to register. A no-op when CUDA is absent or ``enabled`` is False.

    The pinning mode is therefore not a trade-off the planner has to search: registered memory
    is the same bytes as pageable memory, and faster to copy. Pageable is only the fallback when
    the driver refuses to register (e.g. a container's locked-memory limit): the first refusal
    is reported once and the remaining buffers stay pageable -- slower transfers, same results.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and torch.cuda.is_available()
        self._registered: list[tuple[int, torch.Tensor]] = []
        self.bytes = 0
        self.failed = ""  # why registration stopped, if it did
        self._finalizer = weakref.finalize(self, _unregister_all, self._registered)
        self._finalizer.atexit = False  # at interpreter exit the process's memory goes anyway

    def pin(self, tensor: torch.Tensor) -> None:
        if not self.enabled or tensor.numel() == 0:
            return
        ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, _HOST_REGISTER_PORTABLE)
        code = getattr(err, "value", err)
        if code != 0:
            cleared = clear_cuda_error()
            self.enabled = False  # keep what is registered; the rest stays pageable
            self.failed = f"cudaHostRegister of {size} bytes failed with CUDA error {code}"
            warnings.warn(f"{self.failed} after {self.bytes / 2**30:.1f} GiB: continuing with pageable host "
                          "memory (slower host<->device copies)"
                          + ("" if cleared else "; the CUDA error state could not be reset"),
                          RuntimeWarning, stacklevel=2)
            return
        self._registered.append((ptr, tensor))
        self.bytes += size

    def release(self) -> None:
        _unregister_all(self._registered)
        self.bytes = 0


@contextlib.contextmanager
def maybe_stream(backend: Backend, stream: object) -> Iterator[None]:
    """Run the body with ``stream`` current on ``backend``'s device (a no-op on CPU)."""
    with backend.use_stream(stream):
        yield
