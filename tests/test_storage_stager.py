"""The optimizer path's use of the SSD tier, end to end on the real disk: per layer, state read
ahead into a bounded staging pool, an AdamW step on the staging buffers, an asynchronous
write-back that returns the slots -- bit-identical to the same steps on state held in DRAM."""

from __future__ import annotations

import threading

import pytest
import torch

from tinypipe.errors import StorageError
from tinypipe.devices.host_buffers import aligned_empty
from tinypipe.storage import SsdStateStore, StagingPool, StateStager
from tinypipe.storage.direct import ALIGN

KINDS = ("master", "exp_avg", "exp_avg_sq")
LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01


def _adamw(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, step: int) -> None:
    p.mul_(1 - LR * WD)
    m.mul_(B1).add_(g, alpha=1 - B1)
    v.mul_(B2).addcmul_(g, g, value=1 - B2)
    denom = (v / (1 - B2**step)).sqrt_().add_(EPS)
    p.addcdiv_(m, denom, value=-LR / (1 - B1**step))


def _grad(step: int, layer: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + layer))


@pytest.mark.parametrize("depth", [1, 3])
def test_read_ahead_adamw_on_staging_buffers_is_bit_identical(tmp_path, depth):
    sizes = [5000, 4096, 12_345, 1, 70_000, 3000, 8191, 20_000]  # elements per layer
    layers = len(sizes)
    keys = {l: [(l, k) for k in KINDS] for l in range(layers)}
    regions = {key: 4 * sizes[l] for l in range(layers) for key in keys[l]}
    pool = StagingPool(slots=3 * depth, slot_bytes=4 * max(sizes))  # depth layers in flight, no more
    ref = {l: [torch.randn(sizes[l], generator=torch.Generator().manual_seed(l)), torch.zeros(sizes[l]),
               torch.zeros(sizes[l])] for l in range(layers)}
    with SsdStateStore(tmp_path, regions, threads=3, chunk_bytes=4 * ALIGN) as store:
        stager = StateStager(store, pool)
        init = aligned_empty(max(sizes))
        for l in range(layers):  # the initial master weights go to the SSD; moments start at zero
            init[: sizes[l]].copy_(ref[l][0])
            store.write((l, "master"), init)
        writes = []
        for step in (1, 2, 3):
            def stage(l: int):
                return stager.stage(keys[l], read=[(l, "master")] if step == 1 else None)

            ahead = {l: stage(l) for l in range(min(depth, layers))}
            for l in range(layers):
                staged = ahead.pop(l)
                slots = staged.wait()
                p, m, v = (slots[key].view(torch.float32, sizes[l]) for key in keys[l])
                if step == 1:
                    m.zero_()
                    v.zero_()
                g = _grad(step, l, sizes[l])
                _adamw(p, m, v, g, step)
                _adamw(*ref[l], g, step)
                writes += staged.write_back()  # lands while the next layers are read
                if l + depth < layers:
                    ahead[l + depth] = stage(l + depth)  # blocks until a write-back freed slots
        store.wait(writes)
        out = aligned_empty(max(sizes))
        for l in range(layers):
            for key, want in zip(keys[l], ref[l]):
                store.read(key, out)
                assert torch.equal(out[: sizes[l]], want), key
    assert pool.free == 3 * depth


def test_slots_return_only_after_the_write_back_landed(tmp_path):
    pool = StagingPool(slots=2, slot_bytes=8 << 20)
    with SsdStateStore(tmp_path, {k: 8 << 20 for k in "abcd"}, threads=1, chunk_bytes=1 << 20) as store:
        stager = StateStager(store, pool)
        staged = stager.stage(["a", "b"], read=[])
        for slot in staged.slots.values():
            slot.data.fill_(9)
        handles = staged.write_back()
        nxt = stager.stage(["c", "d"], read=[])  # waits for both writes; then reuses the slots
        assert all(h.done() for h in handles)
        nxt.release()
        out = aligned_empty(2 << 20)
        store.read("b", out)
        assert bool((out.view(torch.uint8) == 9).all())


def test_stage_is_cancellable_and_misuse_is_refused(tmp_path):
    pool = StagingPool(slots=2, slot_bytes=4096)
    with SsdStateStore(tmp_path, {"a": 4096, "b": 4096, "c": 10_000}) as store:
        with pytest.raises(ValueError, match="does not fit a 4096-byte staging slot"):
            StateStager(store, pool)
    with SsdStateStore(tmp_path, {"a": 4096, "b": 4096}) as store:
        stager = StateStager(store, pool)
        held = stager.stage(["a", "b"], read=[])
        abort = threading.Event()
        abort.set()

        def check() -> None:
            if abort.is_set():
                raise RuntimeError("aborted")

        with pytest.raises(RuntimeError, match="aborted"):
            stager.stage(["a"], check=check)  # the pool is exhausted: blocked, then cancelled
        store.wait(held.write_back(["a"]))  # writes a; both slots return (b was only a buffer)
        with pytest.raises(StorageError, match="already written back"):
            held.write_back()
        assert pool.free == 2
        bad = stager.stage(["b"])
        with pytest.raises(StorageError, match="SSD read of 'b' .* never written"):
            bad.wait()  # b was never written: its read fails, one line
        bad.release()  # an aborting caller gives the slots back
        assert pool.free == 2
