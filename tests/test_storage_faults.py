"""Faults of the SSD tier on real, small filesystems: one-line errors, nothing silently half-written.

Mount-based tests need root (they mount a tmpfs, a ramfs, a read-only tmpfs or a loop-mounted
ext4 under tmp_path) and skip otherwise. Nothing here mocks the OS: free space comes from the
real statvfs, ENOSPC from a really full filesystem, EIO from a loop device shrunk under a mounted
ext4 (its blocks past the new end answer EIO), the O_DIRECT refusal from ramfs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tinypipe.errors import StorageError, TinypipeError
from tinypipe.devices.host_buffers import aligned_empty
from tinypipe.storage import ScratchDir, SsdStateStore, check_free_space
from tinypipe.storage.scratch import PREFIX, free_bytes

from test_storage_scratch import store_child  # noqa: E402 - tests/ is on sys.path (conftest)

root_only = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None,
                               reason="mounting a small filesystem needs root")


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True)


@contextlib.contextmanager
def mounted(where: Path, fstype: str, options: str = "") -> Iterator[Path]:
    where.mkdir()
    args = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(where)]
    r = _run(*args)
    if r.returncode:
        pytest.skip(f"cannot mount {fstype}: {r.stderr.strip()}")
    try:
        yield where
    finally:
        _run("umount", "-l", str(where))


@contextlib.contextmanager
def loop_ext4(tmp: Path, mib: int) -> Iterator[tuple[Path, Path, str]]:
    """An ext4 of ``mib`` MiB on a loop device: (mount point, backing image, loop device)."""
    image, where = tmp / "disk.img", tmp / "mnt"
    with open(image, "wb") as f:
        f.truncate(mib << 20)
    where.mkdir()
    if _run("mkfs.ext4", "-q", "-F", "-b", "4096", "-O", "^has_journal", str(image)).returncode:
        pytest.skip("mkfs.ext4 is unavailable")
    r = _run("mount", "-o", "loop", str(image), str(where))
    if r.returncode:
        pytest.skip(f"cannot loop-mount: {r.stderr.strip()}")
    device = _run("findmnt", "-n", "-o", "SOURCE", str(where)).stdout.strip()
    try:
        yield where, image, device
    finally:
        _run("umount", "-l", str(where))
        _run("losetup", "-d", device)


def _fill(path: Path) -> int:
    """Write a file until the filesystem is full; returns the bytes it took."""
    block, n = b"\x01" * (1 << 20), 0
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(block)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                return n


def _buf(numel: int, value: float) -> torch.Tensor:
    t = aligned_empty(numel)
    t.fill_(value)
    return t


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and isinstance(e, TinypipeError)
    return text


# -- the directory -------------------------------------------------------------------------------
def test_missing_directory_and_a_file_instead(tmp_path):
    with pytest.raises(StorageError, match="does not exist") as e:
        SsdStateStore(tmp_path / "nope", {"x": 4096})
    _one_line(e.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="is not a directory"):
        SsdStateStore(tmp_path / "file", {"x": 4096})


@root_only
def test_read_only_directory(tmp_path):
    with mounted(tmp_path / "ro", "tmpfs", "ro,size=1m") as ro:
        with pytest.raises(StorageError, match="cannot create scratch files .* Read-only file system") as e:
            SsdStateStore(ro, {"x": 4096})
        _one_line(e.value)


# -- free space ----------------------------------------------------------------------------------
def test_free_space_refusal_against_the_real_disk(tmp_path):
    """More than the real filesystem under tmp_path has: refused before anything is created."""
    have = free_bytes(tmp_path)
    assert have is not None
    need = have + (1 << 30)
    with pytest.raises(StorageError, match=r"has .* free; the SSD tier needs .*: free space") as e:
        SsdStateStore(tmp_path, {"x": need})
    _one_line(e.value)
    assert list(tmp_path.iterdir()) == []
    check_free_space(tmp_path, 4096)


@root_only
def test_free_space_refusal_on_a_small_filesystem(tmp_path):
    with mounted(tmp_path / "small", "tmpfs", "size=8m") as small:
        with pytest.raises(StorageError, match=r"has 8.0 MiB free; the SSD tier needs 64.0 MiB"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                SsdStateStore(small, {i: 16 << 20 for i in range(4)})
        assert list(small.iterdir()) == []


@root_only
def test_a_killed_runs_leftover_is_swept_before_free_space_is_checked(tmp_path, capfd):
    with mounted(tmp_path / "small", "tmpfs", "size=32m") as small, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        proc, leftover = store_child(small, "sleep", 20 << 20)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        assert leftover.exists() and free_bytes(small) < 20 << 20
        capfd.readouterr()
        with SsdStateStore(small, {"x": 20 << 20}) as store:
            store.write("x", _buf(5 << 20, 1.0))
        assert "tinypipe: removed SSD scratch left by a killed run" in capfd.readouterr().err
        assert not leftover.exists() and list(small.iterdir()) == []


# -- the disk fills up mid-run ---------------------------------------------------------------------
@root_only
def test_enospc_mid_write_invalidates_the_region(tmp_path):
    with mounted(tmp_path / "small", "tmpfs", "size=32m") as small, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "on tmpfs: occupies RAM"
        store = SsdStateStore(small, {i: 4 << 20 for i in range(4)}, preallocate=False)
        store.write(0, _buf(1 << 20, 1.0))
        _fill(small / "filler")
        with pytest.raises(StorageError, match=r"SSD write to 1 .* No space left on device \(ENOSPC\)") as e:
            store.write(1, _buf(1 << 20, 2.0))
        _one_line(e.value)
        assert not store.valid(1) and store.valid(0)
        with pytest.raises(StorageError, match="invalid: its last write failed .*ENOSPC"):
            store.read(1, aligned_empty(1 << 20))
        out = aligned_empty(1 << 20)
        store.read(0, out)  # untouched regions are intact
        assert bool((out == 1.0).all())
        (small / "filler").unlink()
        store.write(1, _buf(1 << 20, 3.0))  # space again: the region is whole and valid again
        store.read(1, out)
        assert store.valid(1) and bool((out == 3.0).all())
        store.close()
        assert [p.name for p in small.iterdir()] == []


@root_only
def test_preallocation_reserves_the_space_up_front(tmp_path):
    with mounted(tmp_path / "small", "tmpfs", "size=32m") as small, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with SsdStateStore(small, {i: 4 << 20 for i in range(4)}) as store:
            assert store.preallocated
            taken = _fill(small / "filler")
            assert taken <= 16 << 20
            for i in range(4):  # the other writer hit the full disk, we do not
                store.write(i, _buf(1 << 20, float(i)))
            out = aligned_empty(1 << 20)
            store.read(3, out)
            assert bool((out == 3.0).all())


# -- I/O errors ------------------------------------------------------------------------------------
@root_only
def test_eio_from_a_failing_device(tmp_path):
    with loop_ext4(tmp_path, 96) as (mnt, image, device):
        store = SsdStateStore(mnt, {"a": 48 << 20, "b": 4 << 20})
        assert store.direct
        store.write("a", _buf(12 << 20, 5.0))
        os.truncate(image, 4 << 20)  # the device now ends at 4 MiB: blocks beyond answer EIO
        assert _run("losetup", "-c", device).returncode == 0
        with pytest.raises(StorageError, match=r"SSD read of 'a' .* Input/output error \(EIO\)") as e:
            store.read("a", aligned_empty(12 << 20))
        _one_line(e.value)
        assert store.valid("a"), "a failed read says nothing about what is on the disk"
        with pytest.raises(StorageError, match=r"SSD write to 'a' .*\(EIO\)"):
            store.write("a", _buf(12 << 20, 6.0))
        with pytest.raises(StorageError, match="invalid: its last write failed"):
            store.read("a", aligned_empty(12 << 20))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # removing the scratch may fail on the broken disk
            store.close()


def test_short_read_of_a_truncated_file(tmp_path):
    with SsdStateStore(tmp_path, {"a": 4096, "b": 1 << 20}) as store:
        store.write("b", _buf(1 << 18, 1.0))
        os.truncate(store.path, 4096 + 8192)
        with pytest.raises(StorageError, match=r"SSD read of 'b' .* short read: got 8192 of") as e:
            store.read("b", aligned_empty(1 << 18))
        _one_line(e.value)


# -- filesystems without O_DIRECT, or in RAM -------------------------------------------------------
@root_only
def test_ramfs_refuses_o_direct_and_falls_back_once(tmp_path):
    with mounted(tmp_path / "ram", "ramfs") as ram:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store = SsdStateStore(ram, {i: 1 << 20 for i in range(8)}, threads=2, chunk_bytes=256 << 10)
            src = {i: _buf(1 << 18, float(i)) for i in range(8)}
            store.wait([store.write_async(i, src[i]) for i in range(8)])
            out = {i: aligned_empty(1 << 18) for i in range(8)}
            store.wait([store.read_async(i, out[i]) for i in range(8)])
            assert all(torch.equal(out[i], src[i]) for i in range(8))
            store.close()
        texts = [str(w.message) for w in caught]
        assert not store.direct
        assert sum("refuses O_DIRECT: using buffered I/O" in t for t in texts) == 1, texts
        assert sum("on ramfs: its scratch files occupy RAM" in t for t in texts) == 1, texts
        assert list(ram.iterdir()) == []


def test_buffered_mode_round_trips_exactly(tmp_path):
    with SsdStateStore(tmp_path, {"x": 4 * 1001, "y": 4 * 70_000}, direct=False, chunk_bytes=8192) as store:
        assert not store.direct
        for key, n in (("x", 1001), ("y", 70_000)):
            src = _buf(n, 0.0)
            src.copy_(torch.randn(n, generator=torch.Generator().manual_seed(n)))
            store.write(key, src)
            out = aligned_empty(n)
            store.read(key, out)
            assert torch.equal(out, src)


def test_scratch_on_dev_shm_says_it_is_ram():
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    with pytest.warns(RuntimeWarning, match="on tmpfs: its scratch files occupy RAM"):
        scratch = ScratchDir(shm)
    scratch.close()
    assert not any(p.name.startswith(PREFIX) and str(os.getpid()) in p.name for p in shm.iterdir())
