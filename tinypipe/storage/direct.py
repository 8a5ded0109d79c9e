"""One scratch file opened for direct I/O, and the page-aligned transfers on it.

O_DIRECT moves bytes between the caller's buffer and the SSD without the page cache: no second
copy of the state in DRAM (the page cache would otherwise grow to the size of everything the SSD
holds, and its eviction is what makes host memory honest or not), and no copy through the kernel.
It requires the buffer address, the length and the file offset to be multiples of the logical
block size; :data:`ALIGN` (4096) covers every common device. A filesystem that refuses O_DIRECT
at ``open`` (ramfs, some FUSE) or at the first transfer (EINVAL) gets buffered I/O instead, with
``fdatasync`` + ``posix_fadvise(DONTNEED)`` after each transfer so that the page cache does not
keep what was moved.

Python's ``os.preadv``/``os.pwritev`` release the GIL for the syscall, so worker threads overlap
their transfers with each other and with the CPU optimizer.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass

ALIGN = 4096


class ShortReadError(OSError):
    """The file ended before the requested range (truncated or replaced under us)."""


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def buffer_at(address: int, nbytes: int) -> ctypes.Array:
    """A writable buffer-protocol view of ``nbytes`` at ``address`` (the caller keeps the memory
    alive for the duration of the transfer)."""
    return (ctypes.c_char * nbytes).from_address(address)


@dataclass
class ScratchFile:
    """An open scratch file: its path, descriptor, and whether transfers bypass the page cache."""

    path: str
    fd: int
    direct: bool
    preallocated: bool


def _open(path: str, direct: bool, create: bool) -> int:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0) | (os.O_DIRECT if direct else 0)
    return os.open(path, flags, 0o600)


def preallocate(fd: int, nbytes: int) -> bool:
    """Reserve ``nbytes`` of disk for the file now, so a full disk fails here rather than mid-run.

    Calls Linux ``fallocate`` directly: glibc's ``posix_fallocate`` emulates it on filesystems
    without support by writing every block, which for hundreds of GB would take minutes. Returns
    False where the filesystem cannot preallocate; raises OSError (ENOSPC) when the disk is full.
    """
    if nbytes <= 0:
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    fallocate = getattr(libc, "fallocate", None)
    if fallocate is None:  # not glibc: the portable call (may emulate)
        os.posix_fallocate(fd, 0, nbytes)
        return True
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fallocate(fd, 0, 0, nbytes) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise OSError(code, os.strerror(code))


def _probe_direct(fd: int) -> bool:
    """Whether one aligned page can be written and read back through ``fd`` (some filesystems
    accept O_DIRECT at open but refuse the transfer with EINVAL)."""
    raw = ctypes.create_string_buffer(2 * ALIGN)
    start = (-ctypes.addressof(raw)) % ALIGN
    page = buffer_at(ctypes.addressof(raw) + start, ALIGN)
    try:
        os.pwritev(fd, [page], 0)
        os.preadv(fd, [page], 0)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    return True


def open_scratch_file(path: str, nbytes: int, direct: bool = True, prealloc: bool = True) -> ScratchFile:
    """Create ``path`` (it must not exist) sized for ``nbytes``, for direct I/O where possible."""
    fd = -1
    try:
        created = False
        if direct:
            try:
                fd = _open(path, True, True)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                direct = False  # ramfs creates the file, then refuses the flag
                created = os.path.exists(path)
        if fd < 0:
            fd = _open(path, False, not created)
        done = preallocate(fd, nbytes) if prealloc else False
        if not done:
            os.ftruncate(fd, nbytes)  # sparse: space is taken as regions are written
        if direct and nbytes >= ALIGN and not _probe_direct(fd):
            os.close(fd)
            fd = _open(path, False, False)
            direct = False
        return ScratchFile(path, fd, direct, done)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


def read_into(f: ScratchFile, address: int, nbytes: int, offset: int) -> None:
    """Read ``nbytes`` at file ``offset`` into memory at ``address`` (aligned when direct)."""
    done = 0
    while done < nbytes:
        n = os.preadv(f.fd, [buffer_at(address + done, nbytes - done)], offset + done)
        if n == 0:
            raise ShortReadError(errno.EIO, f"short read: got {done} of {nbytes} bytes (file truncated?)")
        done += n
        if f.direct and done < nbytes and done % ALIGN:
            raise ShortReadError(errno.EIO, f"short read: got {done} of {nbytes} bytes")
    if not f.direct:
        os.posix_fadvise(f.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def write_from(f: ScratchFile, address: int, nbytes: int, offset: int) -> None:
    """Write ``nbytes`` from ``address`` at file ``offset``; durable in the device on return
    when buffered (the page cache is flushed and dropped), submitted to it when direct."""
    done = 0
    while done < nbytes:
        n = os.pwritev(f.fd, [buffer_at(address + done, nbytes - done)], offset + done)
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n
        if f.direct and done < nbytes and done % ALIGN:  # the rest would be misaligned: EINVAL
            raise OSError(errno.EIO, f"short write: {done} of {nbytes} bytes")
    if not f.direct:
        os.fdatasync(f.fd)
        os.posix_fadvise(f.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
