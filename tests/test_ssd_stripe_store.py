"""The SSD store striped over several offload directories: each region's chunks spread over all
of them, the store's guarantees per region whichever directory fails, per-directory free space,
sweeps, cleanup and O_DIRECT fallback; the profile and the plan of a striped set.

The directories are subdirectories of tmp_path (one disk here), or a small tmpfs/ramfs mounted
beside them where the test needs a filesystem that fills up or refuses O_DIRECT (root only)."""

from __future__ import annotations

import errno
import gc
import json
import os
import signal
import warnings
from pathlib import Path

import pytest
import torch

import tinypipe
from test_storage_faults import _fill, _one_line, mounted, root_only
from test_storage_scratch import store_child
from tinypipe.cli import main as cli_main
from tinypipe.devices.host_buffers import aligned_empty
from tinypipe.errors import ConfigError, StorageError
from tinypipe.planner import load_hardware
from tinypipe.planner.ssd import free_space, ssd_spec
from tinypipe.storage import SsdStateStore, measure_directories, measure_rates
from tinypipe.storage import store as store_module
from tinypipe.storage.direct import ALIGN
from tinypipe.storage.scratch import PREFIX, free_bytes
from tinypipe.storage.stripe import DirectorySet, parse_directories, stripe_layout

PLAN_13B = ["plan", "--model", "llama-2-13b", "--gpus", "1", "--gpu-memory", "24GiB", "--cpu-memory",
            "128GiB", "--seq-len", "2048", "--global-batch", "16"]


def _dirs(tmp_path: Path, n: int) -> list[Path]:
    out = [tmp_path / f"drive{i}" for i in range(n)]
    for d in out:
        d.mkdir()
    return out


def _random(nbytes: int, seed: int) -> torch.Tensor:
    t = aligned_empty(nbytes, torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
    return t


def _empty(dirs: list[Path]) -> bool:
    return all(not list(d.iterdir()) for d in dirs)


# -- layout --------------------------------------------------------------------------------------
def test_layout_spreads_each_region_over_every_directory_and_balances_the_shares():
    chunk = 1 << 20
    regions = {(layer, k): (5 << 20) + 123 for layer in range(4) for k in ("master", "exp_avg", "exp_avg_sq")}
    regions["norm"] = 10
    layout, shares = stripe_layout(regions, 3, chunk)
    for key, extent in layout.items():
        pieces = extent.chunks(chunk)
        assert sum(p[1] for p in pieces) == regions[key]
        assert all(off % ALIGN == 0 for *_, off in pieces)
        if len(pieces) >= 3:
            assert {p[2] for p in pieces} == {0, 1, 2}, key  # one region's read uses every drive
    assert max(shares) - min(shares) <= chunk
    # no two chunks overlap in any file, and the files are exactly the shares
    used: dict[int, list[tuple[int, int]]] = {0: [], 1: [], 2: []}
    for extent in layout.values():
        for _, length, drive, off in extent.chunks(chunk):
            used[drive].append((off, off + -(-length // ALIGN) * ALIGN))
    for drive, spans in used.items():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert spans[-1][1] == shares[drive]
    # one directory: the single-file layout it always was (consecutive page-aligned extents)
    one, (size,) = stripe_layout({"a": 10, "b": 4097, "c": 4096}, 1, chunk)
    assert [e.bases for e in one.values()] == [(0,), (4096,), (3 * 4096,)] and size == 4 * 4096


# -- round trips and ordering ------------------------------------------------------------------------
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_striped_round_trip_is_exact_with_partial_pages(tmp_path, direct):
    """Odd sizes: a region's last chunk (on whichever directory) ends inside a page, and a tensor of
    exactly the region's size makes the store go through its bounce page."""
    dirs = _dirs(tmp_path, 3)
    sizes = {"a": 5 * 8192 + 17, "b": 3, "c": 8192 * 7, "d": 4096 * 9 + 4095}
    with SsdStateStore(dirs, sizes, threads=2, chunk_bytes=8192, direct=direct) as store:
        assert store.direct == direct and len(store.paths) == 3
        assert all(p.parent.parent == d for p, d in zip(store.paths, dirs))
        src = {k: _random(n, i) for i, (k, n) in enumerate(sizes.items())}
        store.wait([store.write_async(k, src[k]) for k in sizes])
        out = {k: aligned_empty(n, torch.uint8) for k, n in sizes.items()}
        store.wait([store.read_async(k, out[k]) for k in sizes])
        assert all(torch.equal(out[k], src[k]) for k in sizes)
        assert all(os.path.getsize(p) == s for p, s in zip(store.paths, store.shares))
        assert all(s > 0 for s in store.shares)
    assert _empty(dirs)


def test_requests_on_one_region_run_in_order_across_directories(tmp_path):
    dirs = _dirs(tmp_path, 2)
    with SsdStateStore(dirs, {"x": 64 << 10, "y": 64 << 10}, threads=1, chunk_bytes=4096) as store:
        versions = [_random(64 << 10, v) for v in range(6)]
        outs = [aligned_empty(64 << 10, torch.uint8) for _ in versions]
        handles = []
        for v, out in zip(versions, outs):  # write, read, write, read... all in flight at once
            handles.append(store.write_async("x", v))
            handles.append(store.read_async("x", out))
            handles.append(store.write_async("y", versions[-1]))
        store.wait(handles)
        assert all(torch.equal(out, v) for out, v in zip(outs, versions))


# -- a directory that fails ------------------------------------------------------------------------
def test_a_write_failing_on_one_directory_leaves_the_region_unreadable(tmp_path, monkeypatch):
    dirs = _dirs(tmp_path, 2)
    real = store_module.write_from
    broken = {"on": True}

    def write_from(f, address, nbytes, offset):
        if broken["on"] and Path(f.path).parent.parent == dirs[1]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(f, address, nbytes, offset)

    with SsdStateStore(dirs, {"a": 32 << 10, "b": 32 << 10}, threads=2, chunk_bytes=4096) as store:
        store.write("b", _random(32 << 10, 1))
        monkeypatch.setattr(store_module, "write_from", write_from)
        with pytest.raises(StorageError, match=r"SSD write to 'a' .*\(EIO\)") as e:
            store.write("a", _random(32 << 10, 2))
        text = _one_line(e.value)
        assert f"in offload directory {dirs[1]}, one of the 2" in text, text
        assert not store.valid("a") and store.valid("b")
        with pytest.raises(StorageError, match="invalid: its last write failed .*EIO") as e:
            store.read("a", aligned_empty(32 << 10, torch.uint8))
        assert "striped over offload directories" in _one_line(e.value)
        out = aligned_empty(32 << 10, torch.uint8)
        store.read("b", out)  # untouched regions are intact
        assert torch.equal(out, _random(32 << 10, 1))
        broken["on"] = False
        store.write("a", _random(32 << 10, 3))  # whole again: valid and exact
        store.read("a", out)
        assert store.valid("a") and torch.equal(out, _random(32 << 10, 3))
    assert _empty(dirs)


@root_only
def test_enospc_on_one_directory_mid_run(tmp_path):
    (disk,) = _dirs(tmp_path, 1)
    with mounted(tmp_path / "small", "tmpfs", "size=16m") as small, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "on tmpfs: occupies RAM"
        store = SsdStateStore([disk, small], {i: 4 << 20 for i in range(4)}, preallocate=False,
                              chunk_bytes=1 << 20)
        store.write(0, _random(4 << 20, 0))
        _fill(small / "filler")
        with pytest.raises(StorageError, match=r"SSD write to 1 .*No space left on device \(ENOSPC\)") as e:
            store.write(1, _random(4 << 20, 1))
        assert f"in offload directory {small}" in _one_line(e.value)
        assert not store.valid(1) and store.valid(0)
        out = aligned_empty(4 << 20, torch.uint8)
        store.read(0, out)
        assert torch.equal(out, _random(4 << 20, 0))
        (small / "filler").unlink()
        store.close()
        assert _empty([disk, small])


# -- free space, before anything is created ---------------------------------------------------------
def test_each_directory_must_hold_its_share_and_one_filesystem_all_of_its_shares(tmp_path):
    dirs = _dirs(tmp_path, 2)
    have = free_bytes(tmp_path)
    assert have is not None
    first = rf"offload directory {dirs[0]} has .* free; the SSD tier needs"
    with pytest.raises(StorageError, match=first) as e:
        SsdStateStore(dirs, {"x": 2 * have + (2 << 30)})  # each share is more than the disk
    _one_line(e.value)
    assert _empty(dirs)
    # each share fits alone, not both together: they are on one filesystem
    with pytest.raises(StorageError, match="share one filesystem with .* free; the SSD tier needs") as e:
        SsdStateStore(dirs, {"x": have // 4 * 3, "y": have // 4 * 3})
    assert str(dirs[0]) in _one_line(e.value) and str(dirs[1]) in str(e.value)
    assert _empty(dirs)


@root_only
def test_a_small_directory_is_named_before_training(tmp_path):
    (disk,) = _dirs(tmp_path, 1)
    with mounted(tmp_path / "small", "tmpfs", "size=8m") as small, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(StorageError, match=rf"offload directory {small} has 8.0 MiB free; the SSD tier "
                                               r"needs 32.0 MiB"):
            SsdStateStore([disk, small], {i: 16 << 20 for i in range(4)})
        assert _empty([disk, small])


def test_a_directory_listed_twice_or_missing(tmp_path):
    dirs = _dirs(tmp_path, 2)
    with pytest.raises(StorageError, match="listed twice"):
        SsdStateStore([dirs[0], dirs[1], tmp_path / "drive0" / ".." / "drive0"], {"x": 4096})
    with pytest.raises(StorageError, match=r"offload directory .*nope does not exist"):
        SsdStateStore([dirs[0], tmp_path / "nope"], {"x": 4096})
    assert _empty(dirs)


# -- scratch: cleanup and stale files per directory -----------------------------------------------
def test_all_directories_are_cleaned_at_close_and_collection(tmp_path):
    dirs = _dirs(tmp_path, 3)
    store = SsdStateStore(dirs, {"x": 1 << 20}, chunk_bytes=1 << 18)
    assert all(len(list(d.iterdir())) == 1 for d in dirs)
    store.close()
    store.close()
    assert _empty(dirs)
    store = SsdStateStore(dirs, {"x": 1 << 20}, chunk_bytes=1 << 18)
    store.write("x", _random(1 << 20, 0))
    del store
    gc.collect()
    assert _empty(dirs)


def test_a_killed_striped_run_is_swept_and_reported_per_directory(tmp_path, capfd):
    dirs = _dirs(tmp_path, 2)
    proc, left = store_child(dirs[0], "sleep")  # a killed run in the first directory
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    proc, right = store_child(dirs[1], "sleep")  # and one in the second
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    capfd.readouterr()
    with SsdStateStore(dirs, {"x": 1 << 20}) as store:
        store.write("x", _random(1 << 20, 0))
        lines = [x for x in capfd.readouterr().err.splitlines() if "killed run" in x]
        assert len(lines) == 2 and str(left) in lines[0] + lines[1] and str(right) in lines[0] + lines[1]
        assert not left.exists() and not right.exists()
        assert all(len([p for p in d.iterdir() if p.name.startswith(PREFIX)]) == 1 for d in dirs)
    assert _empty(dirs)


@root_only
def test_o_direct_fallback_is_per_directory(tmp_path):
    (disk,) = _dirs(tmp_path, 1)
    with mounted(tmp_path / "ram", "ramfs") as ram:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store = SsdStateStore([disk, ram], {i: 1 << 20 for i in range(4)}, threads=2,
                                  chunk_bytes=256 << 10)
            src = {i: _random(1 << 20, i) for i in range(4)}
            store.wait([store.write_async(i, src[i]) for i in range(4)])
            out = {i: aligned_empty(1 << 20, torch.uint8) for i in range(4)}
            store.wait([store.read_async(i, out[i]) for i in range(4)])
            assert all(torch.equal(out[i], src[i]) for i in range(4))
            assert [d.file.direct for d in store._core.drives] == [True, False] and not store.direct
            store.close()
        texts = [str(w.message) for w in caught]
        assert sum(f"{ram} (ramfs) refuses O_DIRECT" in t for t in texts) == 1, texts
        assert not any(str(disk) in t for t in texts), texts
        assert _empty([disk, ram])


# -- configuration and the command line --------------------------------------------------------------
def test_config_and_cli_forms_of_several_directories(tmp_path):
    a, b = (str(d) for d in _dirs(tmp_path, 2))
    assert tinypipe.Config(offload_dir=a).offload_dir == a
    assert tinypipe.Config(offload_dir=[a]).offload_dir == a
    assert tinypipe.Config(offload_dir=[a, Path(b)]).offload_dir == (a, b)
    assert tinypipe.Config(offload_dir=(a, b)).replace(lr=1e-3).offload_dir == (a, b)
    for bad in ([], [a, ""], [a, 3], 5):
        with pytest.raises(ConfigError, match="offload_dir must be a directory path or a list"):
            tinypipe.Config(offload_dir=bad)
    with pytest.raises(ConfigError, match="offload_dir must be .* listed twice"):
        tinypipe.Config(offload_dir=[a, b, a + "/"])
    assert parse_directories(a) == a
    both = parse_directories(f"{a}, {b}")
    assert both == (a, b) and isinstance(both, DirectorySet) and str(both) == f"{a}, {b}"
    with pytest.raises(StorageError, match="listed twice"):
        parse_directories(f"{a},{a}")


def test_measure_rates_over_a_striped_set(tmp_path, capsys):
    dirs = _dirs(tmp_path, 2)
    r = measure_rates(dirs, 16 << 20, region_bytes=4 << 20, threads=2, chunk_bytes=1 << 20, mixed=True)
    assert r["read_gbps"] > 0 and r["write_gbps"] > 0 and r["mixed_gbps"] > 0 and r["direct"] is True
    got = measure_directories([str(d) for d in dirs], 8 << 20, log=print, region_bytes=4 << 20, threads=2,
                              chunk_bytes=1 << 20)
    assert got["directory"] == [str(d) for d in dirs] and got["nbytes"] == 16 << 20
    assert [x["directory"] for x in got["directories"]] == [str(d) for d in dirs]
    assert all(x["nbytes"] == 8 << 20 and x["mixed_gbps"] > 0 for x in got["directories"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[2].startswith(f"{dirs[0]}, {dirs[1]} striped: SSD read")
    assert all("both at once" in x for x in lines)
    assert _empty(dirs)


def test_profile_then_plan_with_two_directories(tmp_path, capsys):
    a, b = _dirs(tmp_path, 2)
    prof = tmp_path / "profile.json"
    assert cli_main(["profile", "--device", "cpu", "--model", "none", "--offload-dir", f"{a},{b}",
                     "--ssd-bytes", "128MiB", "--output", str(prof)]) == 0
    out = capsys.readouterr().out
    assert f"{a}: SSD read" in out and f"{b}: SSD read" in out and f"{a}, {b} striped: SSD read" in out
    d = json.loads(prof.read_text())
    ssd = d["ssd"]
    assert ssd["directory"] == [str(a), str(b)] and ssd["nbytes"] == 2 * (128 << 20)
    assert [x["directory"] for x in ssd["directories"]] == [str(a), str(b)]
    assert d["ssd_read_gbps"] == ssd["read_gbps"] > 0 and d["ssd_write_gbps"] == ssd["write_gbps"] > 0
    assert all(k in ssd for k in ("mixed_read_gbps", "mixed_write_gbps", "mixed_gbps"))
    assert load_hardware(str(prof)).ssd_read_gbps == d["ssd_read_gbps"]
    assert _empty([a, b])
    assert cli_main(PLAN_13B + ["--hardware", str(prof), "--offload-dir", f"{a},{b}"]) == 0
    out = capsys.readouterr().out
    assert f"SSD tier ({a}, {b}; read {d['ssd_read_gbps']:.2f} GB/s" in out and "hardware file" in out
    assert cli_main(["profile", "--device", "cpu", "--model", "none", "--offload-dir",
                     f"{a},{tmp_path}/no", "--output", str(prof)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no does not exist" in err[0]


def test_the_planner_sees_the_striped_set(tmp_path):
    a, b = (str(d) for d in _dirs(tmp_path, 2))
    one = free_space(a)
    assert one is not None and abs(free_space((a, b)) - one) < 1 << 30  # one filesystem: shared
    spec = ssd_spec(load_hardware("h200-pcie5"), directory=[a, b], read_gbps=4.0, write_gbps=6.0)
    assert spec.directory == (a, b) and str(spec.directory) == f"{a}, {b}"
    assert (spec.read_gbps, spec.write_gbps) == (4.0, 6.0)
    cfg = tinypipe.Config(offload_dir=spec.directory)  # what plan results hand the engine
    assert cfg.offload_dir == (a, b) and type(cfg.offload_dir) is tuple
