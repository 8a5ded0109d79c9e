"""The SSD tier's state store and staging pool on the real disk under pytest's tmp_path.

Exactness (bit-identical round trips of fp32/bf16 state across many regions, with reads and
writes in flight together and from several submitting threads), ordering per region, alignment,
region validity, counters, the bounded staging pool (all-or-nothing FIFO acquire, cancellation),
store cancellation and cleanup, and the rate probe.
"""

from __future__ import annotations

import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tinypipe.devices.backend import HostPinner
from tinypipe.errors import StorageError
from tinypipe.devices.host_buffers import aligned_empty
from tinypipe.storage import SsdStateStore, StagingPool, direct, measure_rates
from tinypipe.storage.direct import ALIGN
from tinypipe.storage.scratch import PREFIX


def _scratch_dirs(parent) -> list:
    return [p for p in parent.iterdir() if p.name.startswith(PREFIX)]


def _state(numel: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = aligned_empty(numel, dtype)
    t.copy_(torch.randn(numel, generator=g).to(dtype))
    return t


# Sizes chosen to hit every path: sub-page, exactly a page, page + 1 element, several chunks with a
# ragged tail, and an empty region.
SIZES = [1, 7, 1024, 1025, 3 * 4096 + 3, 40_000, 0]


def _regions(layers: int) -> dict[tuple[int, str], int]:
    kinds = ("master", "exp_avg", "exp_avg_sq")
    return {(l, k): 4 * SIZES[(l * 3 + i) % len(SIZES)] for l in range(layers) for i, k in enumerate(kinds)}


def test_round_trip_many_regions_concurrent(tmp_path):
    regions = _regions(24)
    with SsdStateStore(tmp_path, regions, threads=4, chunk_bytes=16 * ALIGN) as store:
        assert store.direct, "ext4 under tmp_path takes O_DIRECT"
        src = {k: _state(n // 4, seed=i) for i, (k, n) in enumerate(regions.items())}
        out = {k: aligned_empty(n // 4) for k, n in regions.items()}
        writes = [store.write_async(k, src[k]) for k in regions]
        reads = [store.read_async(k, out[k]) for k in regions]  # ordered after each region's write
        store.wait(writes + reads)
        for k in regions:
            assert torch.equal(out[k], src[k]), k


def test_reads_and_writes_from_several_threads_keep_per_region_order(tmp_path):
    regions = {(l, k): 4 * 5000 for l in range(16) for k in ("m", "v")}
    with SsdStateStore(tmp_path, regions, threads=3, chunk_bytes=2 * ALIGN) as store:
        def layer(key: tuple[int, str]) -> bool:
            a, b = _state(5000, hash(key) % 1000), _state(5000, hash(key) % 1000 + 1)
            got_a, got_b = aligned_empty(5000), aligned_empty(5000)
            hs = [store.write_async(key, a), store.read_async(key, got_a),
                  store.write_async(key, b), store.read_async(key, got_b)]
            store.wait(hs)
            return torch.equal(got_a, a) and torch.equal(got_b, b)

        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(layer, regions))


def test_bf16_and_staging_slot_views(tmp_path):
    pool = StagingPool(slots=2, slot_bytes=3 * 4096 + 10)
    assert pool.slot_bytes == 4 * 4096 and pool.nbytes == 8 * 4096
    w = _state(6000, 3, torch.bfloat16)
    with SsdStateStore(tmp_path, {"w": w.numel() * 2}) as store:
        a, b = pool.acquire(2)
        a.view(torch.bfloat16, 6000).copy_(w)
        store.write("w", a.data)  # the whole slot: larger than the region, first bytes are written
        store.read("w", b.view(torch.bfloat16, 6000))  # exact-size view: ragged tail via bounce page
        assert torch.equal(b.view(torch.bfloat16, 6000), w)
        store.read("w", b.data)
        assert torch.equal(b.view(torch.bfloat16, 6000), w)
        pool.release([a, b])


def test_layout_is_page_aligned_and_reads_never_spill_past_the_tensor(tmp_path):
    regions = {"a": 10, "b": 4097, "c": 4096, "d": 3}
    with SsdStateStore(tmp_path, regions) as store:
        offsets = [store._core.layout[k].bases[0] for k in regions]
        assert all(o % ALIGN == 0 for o in offsets) and offsets == [0, 4096, 3 * 4096, 4 * 4096]
        assert store.nbytes == 5 * 4096
        for key, n in regions.items():
            src = aligned_empty(n, torch.uint8)
            src.copy_(torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8))
            store.write(key, src)
            backing = aligned_empty(n + 64, torch.uint8)
            backing.fill_(0xAB)
            store.read(key, backing[:n])
            assert torch.equal(backing[:n], src)
            assert bool((backing[n:] == 0xAB).all()), f"read of {key} wrote past the tensor"


def test_misuse_is_refused(tmp_path):
    with SsdStateStore(tmp_path, {"x": 8192}) as store:
        buf = aligned_empty(4096)  # 16 KiB
        with pytest.raises(ValueError, match="4096-byte boundary"):
            store.write_async("x", buf[1:2049])
        with pytest.raises(ValueError, match="bytes, the region"):
            store.write_async("x", buf[:100])
        with pytest.raises(ValueError, match="contiguous"):
            store.write_async("x", buf.view(64, 64).t())
        with pytest.raises(KeyError, match="no SSD region"):
            store.read_async("y", buf)
    with pytest.raises(StorageError, match="after the store was closed"):
        store.read_async("x", buf)


def test_never_written_region_cannot_be_read(tmp_path):
    with SsdStateStore(tmp_path, {"x": 4096}) as store:
        assert not store.valid("x")
        with pytest.raises(StorageError, match=r"SSD read of 'x' .* failed: region is never written"):
            store.read("x", aligned_empty(1024))


def test_counters_and_records(tmp_path):
    regions = {i: 1 << 20 for i in range(6)}
    with SsdStateStore(tmp_path, regions, threads=2, chunk_bytes=256 << 10) as store:
        buf = _state(1 << 18, 0)
        before = store.stats.totals()
        store.wait([store.write_async(i, buf) for i in regions])
        store.wait([store.read_async(i, aligned_empty(1 << 18)) for i in regions])
        step = store.stats.totals() - before
        assert step.write_bytes == step.read_bytes == 6 << 20
        assert step.write_requests == step.read_requests == 6 and step.errors == 0
        assert step.read_busy_s > 0 and step.write_busy_s > 0 and step.read_gbps > 0
        records = store.stats.take_records()
        assert sorted(r.lane for r in records) == ["ssd:read"] * 6 + ["ssd:write"] * 6
        assert all(r.submitted <= r.started <= r.finished and r.nbytes == 1 << 20 for r in records)
        assert store.stats.take_records() == []
        # busy time is the union of in-flight intervals, never more than the wall time
        span = max(r.finished for r in records) - min(r.started for r in records)
        assert step.read_busy_s + step.write_busy_s <= span + 1e-3
        assert store.host_bytes == 2 * 2 * ALIGN


def test_done_callback_releases_a_slot(tmp_path):
    pool = StagingPool(1, 1 << 20)
    with SsdStateStore(tmp_path, {"x": 1 << 20}) as store:
        (slot,) = pool.acquire()
        slot.data.fill_(7)
        store.write_async("x", slot.data).add_done_callback(lambda h: pool.release(slot))
        (again,) = pool.acquire(timeout=10)  # only free once the write landed
        store.read("x", again.data)
        assert bool((again.data == 7).all())


def test_failing_done_callback_surfaces(tmp_path):
    with SsdStateStore(tmp_path, {"x": 4096}) as store:
        h = store.write_async("x", aligned_empty(1024))
        h.wait()
        h2 = store.write_async("x", aligned_empty(1024))

        def boom(_):
            raise RuntimeError("boom")

        h2.add_done_callback(boom)
        h2.wait()
        with pytest.raises(StorageError, match="done-callback failed: boom"):
            store.read_async("x", aligned_empty(1024))


def test_cancel_drops_queued_requests_and_invalidates_their_regions(tmp_path):
    regions = {i: 8 << 20 for i in range(12)}
    store = SsdStateStore(tmp_path, regions, threads=1, chunk_bytes=1 << 20)
    src = _state(2 << 20, 1)
    handles = [store.write_async(i, src) for i in regions]
    store.cancel()
    failed = []
    for i, h in enumerate(handles):
        try:
            h.wait(timeout=60)
        except StorageError as e:
            assert "cancelled" in str(e)
            failed.append(i)
    assert failed, "a single worker cannot have written 96 MiB before cancel() returned"
    for i in failed:
        assert not store.valid(i)
        with pytest.raises(StorageError, match="invalid: its last write failed \\(cancelled\\)"):
            store.read(i, aligned_empty(2 << 20))
    store.close()
    assert _scratch_dirs(tmp_path) == []


def test_wait_check_abandons_the_wait_not_the_transfer(tmp_path, monkeypatch):
    # the writes are held at a gate until the wait was abandoned: on a disk (or a page cache) fast
    # enough to land 128 MiB before the first poll, a timer alone raced the transfer and lost
    gate = threading.Event()
    pwritev = direct.os.pwritev

    def gated(fd, buffers, offset):
        gate.wait(30)
        return pwritev(fd, buffers, offset)

    with SsdStateStore(tmp_path, {i: 16 << 20 for i in range(8)}, threads=1, chunk_bytes=1 << 20) as store:
        src = _state(4 << 20, 2)
        monkeypatch.setattr(direct.os, "pwritev", gated)
        handles = [store.write_async(i, src) for i in range(8)]
        calls = []

        def check():
            calls.append(1)
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            handles[-1].wait(check)
        assert calls == [1] and not handles[-1].done()
        gate.set()
        store.wait(handles)  # the transfers were not disturbed
        out = aligned_empty(4 << 20)
        store.read(7, out)
        assert torch.equal(out, src)


def test_store_removed_when_closed_or_collected(tmp_path):
    store = SsdStateStore(tmp_path, {"x": 4096})
    path = store.path
    assert path.exists() and len(_scratch_dirs(tmp_path)) == 1
    store.close()
    store.close()
    assert not path.exists() and _scratch_dirs(tmp_path) == []
    store = SsdStateStore(tmp_path, {"x": 4096})
    store.write("x", aligned_empty(1024))
    del store
    gc.collect()
    assert _scratch_dirs(tmp_path) == []


def test_staging_pool_is_aligned_and_all_or_nothing_fifo():
    pool = StagingPool(4, 10_000, HostPinner(enabled=True))  # pinning is a no-op without CUDA
    assert all(s.data.data_ptr() % 4096 == 0 and s.data.numel() == 12288 for s in pool.slots)
    held = pool.acquire(3)
    order: list[str] = []

    def take(name: str, n: int) -> None:
        got = pool.acquire(n, timeout=30)
        order.append(name)
        pool.release(got)

    big = threading.Thread(target=take, args=("big", 2))
    big.start()
    time.sleep(0.2)
    small = threading.Thread(target=take, args=("small", 1))
    small.start()
    time.sleep(0.2)
    assert order == [], "one slot is free, but the earlier 2-slot request comes first"
    pool.release(held[0])
    big.join(10)
    small.join(10)
    assert order == ["big", "small"]
    pool.release(held[1:])
    assert pool.free == 4
    with pytest.raises(ValueError, match="not held"):
        pool.release(pool.slots[0])
    with pytest.raises(ValueError, match="cannot take 5"):
        pool.acquire(5)


def test_staging_pool_acquire_is_cancellable():
    pool = StagingPool(1, 4096)
    held = pool.acquire()
    abort = threading.Event()

    def check() -> None:
        if abort.is_set():
            raise RuntimeError("step aborted")

    result: list[BaseException] = []

    def waiter() -> None:
        try:
            pool.acquire(check=check)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            result.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    abort.set()
    pool.interrupt()
    t.join(5)
    assert not t.is_alive() and "step aborted" in str(result[0])
    with pytest.raises(StorageError, match="within 0.1 s"):
        pool.acquire(timeout=0.1)
    pool.release(held)
    assert len(pool.acquire()) == 1  # the cancelled waiter left the queue
    pool.close()
    with pytest.raises(StorageError, match="closed"):
        pool.acquire()


@pytest.mark.gpu
def test_staging_pool_pins_its_buffer():
    pinner = HostPinner(enabled=True)
    pool = StagingPool(3, 1 << 20, pinner)
    assert pinner.bytes == pool.nbytes == 3 << 20
    dev = torch.empty(1 << 18, device="cuda")
    dev.copy_(pool.slots[0].view(torch.float32, 1 << 18), non_blocking=True)
    torch.cuda.synchronize()
    pinner.release()


def test_measure_rates_cleans_up(tmp_path):
    rates = measure_rates(tmp_path, 16 << 20, region_bytes=4 << 20, threads=2, chunk_bytes=1 << 20)
    assert rates["read_gbps"] > 0 and rates["write_gbps"] > 0 and rates["direct"] is True
    assert rates["nbytes"] == 16 << 20
    assert list(tmp_path.iterdir()) == []


def test_done_callback_may_submit(tmp_path):
    """Callbacks run outside the store's lock: chaining a request from one cannot deadlock."""
    with SsdStateStore(tmp_path, {"a": 1 << 16, "b": 1 << 16}) as store:
        src, out = _state(1 << 14, 5), aligned_empty(1 << 14)
        chained: list = []
        store.write_async("a", src).add_done_callback(lambda h: chained.append(store.read_async("a", out)))
        deadline = time.monotonic() + 10
        while not chained and time.monotonic() < deadline:
            time.sleep(0.01)
        chained[0].wait(timeout=10)
        assert torch.equal(out, src)


def test_forked_child_leaves_the_parents_files_alone(tmp_path):
    import os
    import warnings

    store = SsdStateStore(tmp_path, {"x": 4096})
    store.write("x", aligned_empty(1024))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a multi-threaded process
        pid = os.fork()
    if pid == 0:  # the child: what its exit would run (finalizers), then leave without atexit
        try:
            store.close()
            for drive in store._core.drives:
                drive.scratch.close()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert store.path.exists()
    store.read("x", aligned_empty(1024))  # still usable in the parent
    store.close()
    assert _scratch_dirs(tmp_path) == []


def test_measure_rates_mixed(tmp_path):
    """Reads and writes in flight together: both rates and the drive's throughput under the mix."""
    rates = measure_rates(tmp_path, 16 << 20, region_bytes=4 << 20, threads=2, chunk_bytes=1 << 20, mixed=True)
    assert rates["mixed_read_gbps"] > 0 and rates["mixed_write_gbps"] > 0
    # two regions read and two written: the throughput counts both, over the longer of the two waits
    slowest = min(rates["mixed_read_gbps"], rates["mixed_write_gbps"])
    assert slowest <= rates["mixed_gbps"] <= 2 * max(rates["mixed_read_gbps"], rates["mixed_write_gbps"])
    assert list(tmp_path.iterdir()) == []
    assert "mixed_gbps" not in measure_rates(tmp_path, 8 << 20, region_bytes=4 << 20, threads=2,
                                             chunk_bytes=1 << 20)
