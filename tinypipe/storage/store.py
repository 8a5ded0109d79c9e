"""Training state on the SSD: named regions of scratch files, read and written asynchronously.

Each region (e.g. ``(layer, "exp_avg")``) has a fixed, page-aligned extent in one preallocated
file under the run's scratch directory. ``read_async``/``write_async`` split a request into
chunks of ``chunk_bytes`` served by ``threads`` workers doing direct ``preadv``/``pwritev``
(see :mod:`tinypipe.storage.direct`), so several requests -- several layers -- are in flight and
one large region is transferred by several threads at once.

Several offload directories (one per drive): each gets its own scratch directory, file and
``threads`` workers, and every region's chunks go round-robin over them
(:mod:`tinypipe.storage.stripe` says why), so one layer's read keeps every drive busy. Free space,
stale-scratch sweeps, preallocation and the O_DIRECT fallback are per directory; the guarantees
below are per region, whichever drives its chunks are on.

Guarantees the optimizer path relies on:

- Requests on one region run in the order they were issued (a read issued after a write sees
  the written bytes); requests on different regions run concurrently.
- A region that was never written, or whose last write failed or was cancelled, cannot be read:
  the read fails with a one-line StorageError naming the region, the file (and directory) and
  the cause. A failed write -- on any one of the directories -- never leaves a half-written
  region that reads back as valid.
- The caller's buffer must stay untouched until the request's handle is done (the store keeps a
  reference to it). Buffers must start on a page boundary (``aligned_empty``, a StagingPool
  slot); a region's size need not be a multiple of a page.

Why this path (measured 2026-12-01 on the CPU machine: ext4 on a virtio disk, 2 shared cores;
``bench/archive/ssd_rates.py /tmp --gib 2 --reps 4``, raw rows in ``bench/results/ssd_rates_cpu.json``;
medians of 4, read / write GB/s, writes including the final flush; dd with direct I/O, one
64 MiB request at a time, gave 1.1 / 1.7):

=========  ===========  ===========  ===========
threads    4 MiB        16 MiB       64 MiB
=========  ===========  ===========  ===========
1          1.49 / 2.82  1.45 / 2.89  1.89 / 2.50
2          1.61 / 2.99  2.20 / 2.78  2.15 / 2.58
4          2.13 / 3.61  1.64 / 2.97  1.55 / 2.46
8          2.53 / 2.66  2.10 / 3.20  1.52 / 3.58
16         1.76 / 2.88  2.51 / 2.67  1.52 / 3.72
=========  ===========  ===========  ===========

The disk is shared and the spread between repetitions (1.1-2.6 read) is larger than between
settings; what is consistent is that one request at a time reads slowest and that several in
flight reach the device's rate. Buffered I/O (the fallback) reached 1.82 / 1.59 but cost 0.40
CPU s/GB against 0.12 for O_DIRECT -- CPU the AdamW step needs on a 2-core host -- and passes
every byte through the page cache. DeepSpeed's aio op needs libaio, absent here and on the GPU
machine; kvikio and ``torch.cuda.gds`` move file <-> GPU memory, not the host staging buffers the
CPU optimizer works on. The GPU machine's disk reached 1.6 / 2.4 GB/s with 16 threads x 64 MiB.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import queue
import secrets
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tinypipe.errors import StorageError
from tinypipe.devices.host_buffers import aligned_empty
from tinypipe.storage.direct import ALIGN, ScratchFile, align_up, open_scratch_file, read_into, write_from
from tinypipe.storage.frozen_source import ExternalRegion, FileHandles
from tinypipe.storage.io_stats import IoRecord, IoStats
from tinypipe.storage.scratch import ScratchDir, check_directory, format_bytes, free_bytes, sweep_stale
from tinypipe.storage.stripe import Extent, as_directories, check_shares, stripe_layout

#: Worker threads per offload directory: requests in flight at its device (8 reached the disk's rate
#: above; they sleep in the syscall, so they cost no CPU while waiting).
DEFAULT_THREADS = 8


def bounce_bytes(threads: int = DEFAULT_THREADS, directories: int = 1) -> int:
    """Host bytes a store's workers hold besides the staging pools: two pages each (a partial
    page's bounce buffer), ``threads`` per directory; the planner counts them with the pools."""
    return threads * directories * 2 * ALIGN


#: Largest transfer one worker does at once: small enough that one layer's region (tens to hundreds
#: of MiB) is spread over all threads, large enough that syscall overhead is nil.
DEFAULT_CHUNK_BYTES = 16 << 20
#: How often a blocked ``wait`` runs its ``check`` callback (seconds).
POLL_S = 0.05

_EMPTY, _VALID, _WRITING = "never written", "valid", "being written"


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        name = errno.errorcode.get(e.errno, str(e.errno))
        text = e.strerror or str(e)
        return f"{text} ({name})"
    return str(e) or type(e).__name__


class IoHandle:
    """A submitted request; ``wait()`` returns its :class:`IoRecord` or raises StorageError."""

    def __init__(self, op: str, key: Hashable, nbytes: int, tensor: torch.Tensor, capacity: int) -> None:
        self.op, self.key, self.nbytes = op, key, nbytes
        self.submitted = time.perf_counter()
        self.error: StorageError | None = None
        self.record: IoRecord | None = None
        self._tensor: torch.Tensor | None = tensor  # kept alive until done
        self._address = tensor.data_ptr()
        self._capacity = capacity  # bytes at the address the transfer may touch (whole pages)
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._pending = 0
        self._first_error: str | None = None
        self._error_at: tuple[int, int] | None = None  # (drive, file offset) of the first failed chunk
        self._started: float | None = None
        self._successors: list[IoHandle] = []
        self._callbacks: list[Callable[[IoHandle], None]] = []

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, check: Callable[[], None] | None = None, timeout: float | None = None) -> IoRecord:
        """Block until done. ``check`` runs every :data:`POLL_S` (what it raises abandons the wait,
        not the transfer); ``timeout`` seconds raise StorageError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._event.wait(POLL_S):
            if check is not None:
                check()
            if deadline is not None and time.monotonic() >= deadline:
                raise StorageError(f"SSD {self.op} of {self.key!r} did not finish within {timeout:.1f} s")
        if self.error is not None:
            raise self.error
        assert self.record is not None
        return self.record

    def add_done_callback(self, fn: Callable[[IoHandle], None]) -> None:
        """Call ``fn(handle)`` once the request is done (in a worker thread, or now if it is).
        E.g. release a staging slot once its write-back landed, without a thread waiting."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)


@dataclass(eq=False)
class _Drive:
    """One offload directory's part of a store: its scratch file and its own workers."""

    parent: Path  # the offload directory
    file: ScratchFile
    scratch: ScratchDir | None  # removed at shutdown (None: the caller's to remove)
    tasks: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    workers: list[threading.Thread] = field(default_factory=list)


class _Core:
    """Everything the worker threads and the finalizer need (never the store object itself, so
    that dropping the store runs its finalizer)."""

    def __init__(self, drives: list[_Drive], layout: dict[Hashable, Extent], threads: int, chunk_bytes: int,
                 external: Mapping[Hashable, ExternalRegion]) -> None:
        self.drives, self.layout = drives, layout
        self.external = dict(external)  # read-only regions in the model's checkpoint files
        self.files = FileHandles()
        self.chunk_bytes = chunk_bytes
        self.stats = IoStats()
        self.state: dict[Hashable, str] = dict.fromkeys(layout, _EMPTY)
        self.state.update(dict.fromkeys(self.external, _VALID))
        self.tails: dict[Hashable, IoHandle] = {}
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.cancelled = False
        self.closed = False
        self.failure: BaseException | None = None  # a done-callback raised
        self.due: list[tuple[Callable[[IoHandle], None], IoHandle]] = []  # callbacks to run unlocked
        self.owner_pid = os.getpid()
        for d, drive in enumerate(drives):
            name = "tinypipe-ssd" if len(drives) == 1 else f"tinypipe-ssd{d}"
            drive.workers = [threading.Thread(target=self.work, args=(drive,), name=f"{name}-{i}",
                                              daemon=True) for i in range(threads)]
            for t in drive.workers:
                t.start()

    # -- submission (under self.lock) --------------------------------------------------------
    def submit(self, handle: IoHandle) -> None:
        prev = self.tails.get(handle.key)
        self.tails[handle.key] = handle
        if prev is not None and not prev.done():
            prev._successors.append(handle)
        else:
            self.launch(handle)

    def launch(self, handle: IoHandle) -> None:
        """Start ``handle`` now that every earlier request on its region is done."""
        key = handle.key
        if handle.op == "read" and self.state[key] != _VALID:
            self.finish(handle, f"region is {self.state[key]}")
            return
        if self.cancelled:
            self.finish(handle, "cancelled")
            return
        ext = self.external.get(key)
        if ext is not None:  # a checkpoint's tensors: one task per tensor, one for the gaps
            if handle.op == "write":
                self.finish(handle, "the region is the model's own checkpoint (read-only)")
                return
            handle._pending = ext.parts
            for part in range(ext.parts):
                self.drives[part % len(self.drives)].tasks.put((handle, part, 0, 0))
            return
        if handle.op == "write":
            self.state[key] = _WRITING
        chunks = self.layout[key].chunks(self.chunk_bytes)
        handle._pending = len(chunks)
        if not chunks:
            self.finish(handle, None)
        for start, length, drive, offset in chunks:
            self.drives[drive].tasks.put((handle, start, length, offset))

    def where(self, handle: IoHandle) -> str:
        """The region's place for an error message: its file and offset, the directory with the
        failing chunk when it is striped."""
        key = handle.key
        if key in self.external:
            return f"the checkpoint {', '.join(self.external[key].paths)}"
        extent = self.layout[key]
        if len(self.drives) == 1:
            return f"{self.drives[0].file.path}:{extent.bases[0]}"
        if handle._error_at is not None:
            d, offset = handle._error_at
            return (f"{self.drives[d].file.path}:{offset}, in offload directory {self.drives[d].parent}, "
                    f"one of the {len(self.drives)} it is striped over")
        return f"striped over offload directories {', '.join(str(d.parent) for d in self.drives)}"

    def finish(self, handle: IoHandle, error: str | None) -> None:
        """Complete ``handle`` (under self.lock): region state, stats, waiters, successors."""
        now = time.perf_counter()
        key = handle.key
        nbytes = self.layout[key].nbytes
        where = self.where(handle) if error is not None else ""
        if error is not None:
            verb = "read of" if handle.op == "read" else "write to"
            handle.error = StorageError(f"SSD {verb} {key!r} ({nbytes} bytes at {where}) failed: {error}")
        if handle.op == "write" and key not in self.external:
            # a later read of the region names where the write failed (a striped region's read
            # alone would name every directory)
            self.state[key] = (_VALID if error is None
                               else f"invalid: its last write failed ({error}) at {where}")
        started = handle._started if handle._started is not None else now
        record = IoRecord(handle.op, key, nbytes, handle.submitted, started, now, error)
        handle.record = record
        if handle._started is not None:
            self.stats.finished(record)
        handle._tensor = None
        with handle._lock:
            handle._event.set()
            callbacks, handle._callbacks = handle._callbacks, []
        self.due.extend((fn, handle) for fn in callbacks)
        if self.tails.get(key) is handle:
            del self.tails[key]
        for nxt in handle._successors:
            self.launch(nxt)
        handle._successors = []
        if not self.tails:
            self.idle.notify_all()

    def run_due(self) -> None:
        """Run the done-callbacks of finished requests, outside the lock (they may submit)."""
        with self.lock:
            due, self.due = self.due, []
        for fn, handle in due:
            try:
                fn(handle)
            except BaseException as e:  # surfaced by the store's next call
                self.failure = self.failure or e

    # -- workers ------------------------------------------------------------------------------
    def work(self, drive: _Drive) -> None:
        bounce = aligned_empty(ALIGN, torch.uint8, zero=True)
        while True:
            task = drive.tasks.get()
            if task is None:
                return
            handle, start, length, offset = task
            error: str | None = None
            with handle._lock:
                first = handle._started is None
                if first:
                    handle._started = time.perf_counter()
            if first:
                self.stats.started(handle.op, handle._started)
            if handle._first_error is None and not self.cancelled:
                try:
                    self.transfer(drive.file, handle, start, length, offset, bounce)
                except OSError as e:
                    error = _describe(e)
                    if e.errno == errno.ENOSPC:
                        error += f"; {self.space_left(drive)}"
                except Exception as e:  # noqa: BLE001 - a worker must never die with a request open
                    error = f"{type(e).__name__}: {e}"
            elif self.cancelled:
                error = "cancelled"
            with self.lock:
                if error is not None and handle._first_error is None:
                    handle._first_error = error
                    handle._error_at = (self.drives.index(drive), offset)
                handle._pending -= 1
                if handle._pending == 0:
                    self.finish(handle, handle._first_error)
            self.run_due()

    def transfer(self, file: ScratchFile, handle: IoHandle, start: int, length: int, file_offset: int,
                 bounce: torch.Tensor) -> None:
        ext = self.external.get(handle.key)
        if ext is not None:  # ``start`` is the part
            assert handle._tensor is not None
            ext.read_part(start, handle._tensor, self.files)
            return
        address = handle._address + start
        move = read_into if handle.op == "read" else write_from
        if not file.direct or start + align_up(length) <= handle._capacity:
            move(file, address, align_up(length) if file.direct else length, file_offset)
            return
        body = length - length % ALIGN
        if body:
            move(file, address, body, file_offset)
        tail, page = length - body, bounce.data_ptr()
        if handle.op == "read":
            read_into(file, page, ALIGN, file_offset + body)
            ctypes.memmove(address + body, page, tail)
        else:
            ctypes.memset(page, 0, ALIGN)
            ctypes.memmove(page, address + body, tail)
            write_from(file, page, ALIGN, file_offset + body)

    @staticmethod
    def space_left(drive: _Drive) -> str:
        full = f"the disk of {drive.parent} is full"
        try:
            have = free_bytes(drive.parent)
        except OSError:
            return full
        return full if have is None else f"{format_bytes(have)} free on the disk"

    # -- shutdown ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Finish what is in flight, stop the workers, close and remove the files (idempotent). In
        a forked child (which inherited the store) it only closes the descriptors: the files are
        the parent's."""
        if os.getpid() != self.owner_pid:
            for drive in self.drives:
                with contextlib.suppress(OSError):
                    os.close(drive.file.fd)
            return
        with self.lock:
            if self.closed:
                return
            self.closed = True
            while self.tails:
                self.idle.wait(POLL_S)
        for drive in self.drives:
            for _ in drive.workers:
                drive.tasks.put(None)
        for drive in self.drives:
            for t in drive.workers:
                if t is not threading.current_thread():
                    t.join(timeout=30)
        self.files.close()
        for drive in self.drives:
            _remove_file(drive.file)
            if drive.scratch is not None:
                drive.scratch.close()


def _remove_file(file: ScratchFile) -> None:
    with contextlib.suppress(OSError):
        os.close(file.fd)
    with contextlib.suppress(OSError):
        os.unlink(file.path)


class SsdStateStore:
    """Regions of training state in scratch files on one or several SSDs.

    ``directory`` is the offload directory (a scratch directory is created in it, after sweeping
    leftovers of killed runs, and removed at close), a :class:`ScratchDir` to share, or a sequence
    of either: one per drive, the regions striped over them (:mod:`tinypipe.storage.stripe`).
    ``regions`` maps each key to its size in bytes; their extents are laid out in the mapping's
    order, each chunk starting on a page boundary, and preallocated so that a full disk fails
    here. ``threads`` workers serve each directory. ``external`` regions are read-only and live
    elsewhere (LoRA's frozen base in the model's own safetensors,
    :mod:`tinypipe.storage.frozen_source`): read by the same workers, never in a scratch file.
    """

    def __init__(self, directory: str | os.PathLike | ScratchDir | Sequence[str | os.PathLike | ScratchDir],
                 regions: Mapping[Hashable, int], *, threads: int = DEFAULT_THREADS,
                 chunk_bytes: int | None = None, direct: bool = True, preallocate: bool = True,
                 external: Mapping[Hashable, ExternalRegion] | None = None) -> None:
        """``chunk_bytes``: the largest transfer of one worker, also the stripe unit (None: the
        module's :data:`DEFAULT_CHUNK_BYTES`, read now)."""
        chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, got {chunk_bytes}")
        sources = ([directory] if isinstance(directory, (str, os.PathLike, ScratchDir)) else list(directory))
        parents = [s.parent if isinstance(s, ScratchDir) else check_directory(s) for s in sources]
        as_directories(parents)  # at least one, none twice
        layout, shares = stripe_layout(regions, len(sources), chunk_bytes)
        self.nbytes = sum(shares)  # the scratch files (external regions take none of it)
        self.shares = tuple(shares)  # bytes of each directory's file
        external = dict(external or {})
        for key, ext in external.items():
            if key in layout:
                raise ValueError(f"region {key!r} is both in the scratch file and external")
            layout[key] = Extent(ext.nbytes, 0, ())
        for s in sources:  # a killed run's files must not cause a refusal
            if not isinstance(s, ScratchDir):
                sweep_stale(s)
        check_shares(parents, shares)
        drives: list[_Drive] = []
        try:
            for s, share in zip(sources, shares):
                owned = not isinstance(s, ScratchDir)
                scratch = ScratchDir(s, need=share) if owned else s
                try:
                    file = self._open(scratch, share, direct, preallocate)
                except BaseException:
                    if owned:
                        scratch.close()
                    raise
                drives.append(_Drive(scratch.parent, file, scratch if owned else None))
        except BaseException:
            for drive in drives:
                _remove_file(drive.file)
                if drive.scratch is not None:
                    drive.scratch.close()
            raise
        self.paths = tuple(Path(d.file.path) for d in drives)
        self.path = self.paths[0]  # the first directory's file (the only one, with one directory)
        self.directories = tuple(d.parent for d in drives)
        self.direct = all(d.file.direct for d in drives)
        self.preallocated = all(d.file.preallocated for d in drives)
        self._core = _Core(drives, layout, threads, chunk_bytes, external)
        self._finalizer = weakref.finalize(self, self._core.shutdown)
        self.threads = threads
        self.chunk_bytes = chunk_bytes

    @staticmethod
    def _open(scratch: ScratchDir, nbytes: int, direct: bool, preallocate: bool) -> ScratchFile:
        """One directory's scratch file; one-line errors naming it, a warning per fallback."""
        path = scratch.file(f"state-{secrets.token_hex(4)}.bin")
        try:
            file = open_scratch_file(path, nbytes, direct=direct, prealloc=preallocate)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(path)
            if e.errno == errno.ENOSPC:
                have = format_bytes(free_bytes(scratch.parent) or 0)
                raise StorageError(f"offload directory {scratch.parent} cannot hold the SSD tier's "
                                   f"{format_bytes(nbytes)} ({have} free): free space or choose another "
                                   "directory") from e
            raise StorageError(f"cannot create the SSD tier's scratch file {path}: {_describe(e)}") from e
        if direct and not file.direct:
            fs = scratch.filesystem or "unknown filesystem"
            warnings.warn(f"offload directory {scratch.parent} ({fs}) refuses O_DIRECT: using buffered I/O, "
                          "flushed and dropped from the page cache after each transfer (slower)",
                          RuntimeWarning, stacklevel=3)
        if preallocate and not file.preallocated:
            warnings.warn(f"offload directory {scratch.parent} cannot preallocate: a disk that fills up will "
                          "fail mid-run (one-line error) instead of now", RuntimeWarning, stacklevel=3)
        return file

    # -- facts ---------------------------------------------------------------------------------
    @property
    def stats(self) -> IoStats:
        return self._core.stats

    @property
    def host_bytes(self) -> int:
        """Host memory the store itself holds (bounce pages per worker), for the memory report."""
        return bounce_bytes(self.threads, len(self.paths))

    def region_bytes(self, key: Hashable) -> int:
        return self._region(key).nbytes

    def regions(self) -> list[Hashable]:
        return list(self._core.layout)

    def valid(self, key: Hashable) -> bool:
        """Whether ``key`` holds a completed, successful write (requests in flight not counted)."""
        self._region(key)
        return self._core.state[key] == _VALID

    # -- requests ------------------------------------------------------------------------------
    def read_async(self, key: Hashable, into: torch.Tensor) -> IoHandle:
        """Read region ``key`` into the first bytes of ``into`` (page-aligned, contiguous, CPU)."""
        return self._submit("read", key, into)

    def write_async(self, key: Hashable, src: torch.Tensor) -> IoHandle:
        """Write the first ``region_bytes(key)`` bytes of ``src`` to region ``key``."""
        return self._submit("write", key, src)

    def read(self, key: Hashable, into: torch.Tensor, check: Callable[[], None] | None = None) -> IoRecord:
        return self.read_async(key, into).wait(check)

    def write(self, key: Hashable, src: torch.Tensor, check: Callable[[], None] | None = None) -> IoRecord:
        return self.write_async(key, src).wait(check)

    @staticmethod
    def wait(handles: Iterable[IoHandle], check: Callable[[], None] | None = None) -> list[IoRecord]:
        """Wait for all ``handles``; raises the first failure after all are done."""
        records: list[IoRecord] = []
        first: StorageError | None = None
        for h in list(handles):
            try:
                records.append(h.wait(check))
            except StorageError as e:
                first = first or e
        if first is not None:
            raise first
        return records

    def sync(self) -> None:
        """Flush the devices' write caches for the files (what a rate measurement must include;
        training does not need it: scratch is never read back after a crash)."""
        for drive in self._core.drives:
            try:
                os.fsync(drive.file.fd)
            except OSError as e:
                raise StorageError(f"flushing the SSD tier's scratch file {drive.file.path} failed: "
                                   f"{_describe(e)}") from e

    def cancel(self) -> None:
        """Drop every queued request (they fail with "cancelled"; cancelled writes leave their
        region invalid); transfers already running finish. For shutdown after an abort."""
        self._core.cancelled = True

    def close(self) -> None:
        """Finish requests in flight, stop the workers and remove the scratch files (idempotent)."""
        self._finalizer()
        self._raise_failure()

    def __enter__(self) -> SsdStateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _region(self, key: Hashable) -> Extent:
        try:
            return self._core.layout[key]
        except KeyError:
            raise KeyError(f"no SSD region {key!r}") from None

    def _raise_failure(self) -> None:
        failure = self._core.failure
        if failure is not None:
            self._core.failure = None
            raise StorageError(f"an SSD request's done-callback failed: {failure}") from failure

    def _submit(self, op: str, key: Hashable, tensor: torch.Tensor) -> IoHandle:
        self._raise_failure()
        nbytes = self._region(key).nbytes
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"SSD {op} of {key!r} needs a contiguous CPU tensor")
        own = tensor.numel() * tensor.element_size()
        if own < nbytes:
            raise ValueError(f"SSD {op} of {key!r}: the tensor has {own} bytes, the region {nbytes}")
        if tensor.data_ptr() % ALIGN:
            raise ValueError(f"SSD {op} of {key!r}: the tensor must start on a {ALIGN}-byte boundary "
                             "(allocate it with aligned_empty or take a StagingPool slot)")
        if op == "read":
            capacity = own  # never write past the tensor's own bytes
        else:  # reading past the tensor's end inside its own allocation is harmless
            storage = tensor.untyped_storage()
            capacity = storage.nbytes() - (tensor.data_ptr() - storage.data_ptr())
        handle = IoHandle(op, key, nbytes, tensor, capacity)
        core = self._core
        with core.lock:
            if core.closed:
                raise StorageError(f"SSD {op} of {key!r} after the store was closed")
            core.submit(handle)
        core.run_due()
        return handle
