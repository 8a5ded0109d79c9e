"""Scratch directories of the SSD tier: owned by one live process, swept when the owner died.

A run's files live in ``DIR/tinypipe-scratch-<id>/`` next to an ``owner.json`` (pid, host, start
time) that the run keeps ``flock``-ed for its lifetime. The kernel drops the lock when the
process dies -- however it dies, SIGKILL included -- so "the lock can be taken" is exactly "the
owner is gone", without trusting pids (which are reused) or clocks. A directory is created under a
hidden temporary name, locked, and only then renamed into place, so a visible scratch directory
is locked from its first instant and another run's sweep can never mistake it for a leftover.

Scratch is never a checkpoint: it is removed at close, at normal interpreter exit (a finalizer),
and by the next run's sweep after a crash; nothing in it is ever read back across runs. The sweep
reports each leftover it removes (or cannot remove) in one ``tinypipe:`` line on stderr -- a
notice for the person running, not a RuntimeWarning that filters hide or tests turn into errors.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import sys
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

from tinypipe.errors import StorageError

PREFIX = "tinypipe-scratch-"
NEW_PREFIX = ".tinypipe-scratch-new-"
OWNER = "owner.json"
#: A half-created directory (no owner file yet) older than this is a leftover, not a run starting.
NEW_GRACE_S = 60.0
_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def notice(line: str) -> None:
    """One ``tinypipe:`` line on stderr (what the sweep found)."""
    print(f"tinypipe: {' '.join(line.split())}", file=sys.stderr, flush=True)


def format_bytes(n: int | float) -> str:
    """``1.5 GiB`` / ``12.0 MiB``: one decimal in the largest unit that keeps it >= 1."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def check_directory(parent: str | os.PathLike) -> Path:
    """``parent`` as a Path if it is an existing directory; a one-line StorageError otherwise."""
    path = Path(parent)
    if not path.exists():
        raise StorageError(f"offload directory {path} does not exist")
    if not path.is_dir():
        raise StorageError(f"offload directory {path} is not a directory")
    return path


def free_bytes(parent: str | os.PathLike) -> int | None:
    """Bytes an unprivileged writer may still allocate under ``parent``; None where the filesystem
    keeps no account (ramfs reports zero blocks)."""
    st = os.statvfs(parent)
    if st.f_blocks == 0:
        return None
    return st.f_bavail * st.f_frsize


def check_free_space(parent: str | os.PathLike, need: int, what: str = "the SSD tier") -> None:
    """Refuse up front, in one line, when ``parent``'s filesystem has less than ``need`` bytes."""
    have = free_bytes(check_directory(parent))
    if have is not None and have < need:
        raise StorageError(f"offload directory {parent} has {format_bytes(have)} free; {what} needs "
                           f"{format_bytes(need)} ({need} bytes): free space or choose another directory")


def filesystem_type(path: str | os.PathLike) -> str:
    """The type of the filesystem holding ``path`` (e.g. ``ext4``, ``tmpfs``), from mountinfo."""
    target = os.path.realpath(path)
    best, kind = "", ""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount = fields[4].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, right.split()[0]
    return kind


def _proc_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (tells a reused pid from the original)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _owner_record() -> dict:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "started": time.time(), "proc_start": _proc_start(pid)}


@dataclass(frozen=True)
class Leftover:
    """A scratch directory whose owner is gone, as found (and removed) by :func:`sweep_stale`."""

    path: Path
    owner: dict
    nbytes: int

    def describe(self) -> str:
        o = self.owner
        who = f"pid {o['pid']} on {o.get('host', '?')}" if "pid" in o else "an unknown run"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(o["started"])) if "started" in o else "?"
        return (f"removed SSD scratch left by a killed run: {self.path} ({who}, started {when}, "
                f"{format_bytes(self.nbytes)})")


def _remove_tree(path: Path) -> int:
    """Delete a scratch directory (flat: files only), the owner file last; returns bytes freed."""
    freed = 0
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return 0
    for entry in sorted(entries, key=lambda e: e.name == OWNER):
        try:
            freed += entry.stat(follow_symlinks=False).st_blocks * 512
            os.unlink(entry.path)
        except FileNotFoundError:
            pass
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    return freed


def _pid_dead(owner: dict) -> bool:
    """Fallback where flock is unsupported: dead only if provably so on this host."""
    if owner.get("host") != socket.gethostname() or "pid" not in owner:
        return False
    start = _proc_start(int(owner["pid"]))
    return start is None or (owner.get("proc_start") is not None and start != owner["proc_start"])


def _claim_if_stale(path: Path) -> tuple[int, dict] | None:
    """Lock ``path``'s owner file if its owner is gone: (lock fd, owner record), else None."""
    owner_path = path / OWNER
    try:
        fd = os.open(owner_path, os.O_RDWR)
    except FileNotFoundError:
        if path.name.startswith(NEW_PREFIX):
            try:
                young = time.time() - path.stat().st_mtime < NEW_GRACE_S
            except FileNotFoundError:
                return None
            if young:
                return None  # a run that is creating its directory right now
        return -1, {}  # our sweep or cleanup died after removing the owner file
    try:
        try:
            owner = json.loads(os.read(fd, 1 << 16) or b"{}")
        except ValueError:
            owner = {}
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None  # alive
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL) or not _pid_dead(owner):
                os.close(fd)
                return None
        return fd, owner
    except BaseException:
        os.close(fd)
        raise


def sweep_stale(parent: str | os.PathLike) -> list[Leftover]:
    """Remove the scratch directories under ``parent`` whose owner died; one ``tinypipe:`` line
    on stderr for each.

    A live run's directory is never touched (its owner holds the lock). Directories whose owner
    cannot be proven dead (another host, on a filesystem without locks) are left alone."""
    found: list[Leftover] = []
    base = check_directory(parent)
    try:
        entries = list(os.scandir(base))
    except OSError as e:
        raise StorageError(f"cannot read offload directory {base}: {e.strerror or e}") from e
    for entry in entries:
        if not (entry.name.startswith(PREFIX) or entry.name.startswith(NEW_PREFIX)):
            continue
        if not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        claim = _claim_if_stale(path)
        if claim is None:
            continue
        fd, owner = claim
        try:
            nbytes = _remove_tree(path)
        except OSError as e:
            notice(f"SSD scratch left by a killed run at {path} could not be removed: {e.strerror or e}")
            continue
        finally:
            if fd >= 0:
                os.close(fd)
        leftover = Leftover(path, owner, nbytes)
        notice(leftover.describe())
        found.append(leftover)
    return found


def _release(path: Path, fd: int, owner_pid: int) -> None:
    """Finalizer body: remove the directory while still holding its lock, then drop the lock. A
    forked child that inherited the directory must not remove its parent's files at its exit."""
    if os.getpid() != owner_pid:
        return
    try:
        _remove_tree(path)
    except OSError as e:  # e.g. the disk failed: the next run's sweep retries
        warnings.warn(f"could not remove SSD scratch {path}: {e.strerror or e}", RuntimeWarning, stacklevel=2)
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


class ScratchDir:
    """This process's scratch directory under an offload directory.

    Creating one sweeps leftovers of killed runs first, then checks that ``need`` bytes are free
    (after the sweep: a crashed run's files must not cause a refusal). ``close()`` (or the end of
    a ``with`` block, or interpreter exit, or garbage collection) removes it and everything in it.
    """

    def __init__(self, parent: str | os.PathLike, need: int = 0) -> None:
        base = check_directory(parent)
        sweep_stale(base)
        check_free_space(base, need)
        self.parent = base
        self.filesystem = filesystem_type(base)
        tmp = base / f"{NEW_PREFIX}{secrets.token_hex(6)}"
        ident = f"{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(tmp, 0o700)
        except OSError as e:
            raise StorageError(f"cannot create scratch files in offload directory {base}: "
                               f"{e.strerror or e}") from e
        fd = -1
        try:
            fd = os.open(tmp / OWNER, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, json.dumps(_owner_record()).encode())
            self.path = base / f"{PREFIX}{ident}"
            os.rename(tmp, self.path)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            _remove_tree(tmp)
            raise StorageError(f"cannot create scratch files in offload directory {base}: "
                               f"{e.strerror or e}") from e
        self._finalizer = weakref.finalize(self, _release, self.path, fd, os.getpid())
        if self.filesystem in _MEMORY_FILESYSTEMS:
            warnings.warn(f"offload directory {base} is on {self.filesystem}: its scratch files occupy RAM, "
                          "not an SSD", RuntimeWarning, stacklevel=2)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def file(self, name: str) -> str:
        """Path of a scratch file named ``name`` inside the directory."""
        if "/" in name or name in ("", ".", "..", OWNER):
            raise ValueError(f"bad scratch file name {name!r}")
        return str(self.path / name)

    def close(self) -> None:
        """Remove the directory and its files (idempotent)."""
        self._finalizer()

    def __enter__(self) -> ScratchDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
