"""Read and write rates of an offload directory, measured the way the SSD tier moves state.

``tinypipe profile --offload-dir DIR`` records them for the planner: a step that keeps S bytes of
state on the SSD reads and writes S, so these two numbers bound the step time from below.
"""

from __future__ import annotations

import os
import time

import torch

from tinypipe.errors import StorageError
from tinypipe.devices.host_buffers import aligned_empty
from tinypipe.storage.store import DEFAULT_CHUNK_BYTES, DEFAULT_THREADS, SsdStateStore

#: Size of each measured request (one layer's state is tens to hundreds of MiB).
REGION_BYTES = 64 << 20


def measure_rates(directory: str | os.PathLike, nbytes: int = 1 << 30, *, threads: int = DEFAULT_THREADS,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES, region_bytes: int = REGION_BYTES,
                  direct: bool = True, mixed: bool = False) -> dict[str, float | int | bool]:
    """Write then read ``nbytes`` through an :class:`SsdStateStore` in a scratch file under
    ``directory`` (removed afterwards), all requests in flight at once; returns ``read_gbps``,
    ``write_gbps`` (1e9 bytes/s, the write including the final flush), ``direct`` and the setup.

    Host memory: two buffers of ``region_bytes``. The data is random (a compressing SSD would
    flatter zeros) and one region is read back and compared, so a broken path cannot report a rate.
    ``mixed``: also the rates with reads and writes in flight together (:func:`_mixed_rates`).
    """
    regions = {i: region_bytes for i in range(max(1, -(-nbytes // region_bytes)))}
    total = len(regions) * region_bytes
    src = aligned_empty(region_bytes, torch.uint8)
    gen = torch.Generator().manual_seed(0)
    src.copy_(torch.randint(0, 256, (region_bytes,), dtype=torch.uint8, generator=gen))
    dst = aligned_empty(region_bytes, torch.uint8)
    with SsdStateStore(directory, regions, threads=threads, chunk_bytes=chunk_bytes, direct=direct) as store:
        t0 = time.perf_counter()
        store.wait([store.write_async(k, src) for k in regions])
        store.sync()
        t1 = time.perf_counter()
        store.wait([store.read_async(k, dst) for k in regions])
        t2 = time.perf_counter()
        dst.zero_()
        store.read(len(regions) - 1, dst)
        if not torch.equal(dst, src):
            raise StorageError(f"offload directory {directory}: data read back differs from what was written")
        is_direct = store.direct
        out = {"read_gbps": total / (t2 - t1) / 1e9, "write_gbps": total / (t1 - t0) / 1e9,
               "direct": is_direct, "nbytes": total, "threads": threads, "chunk_bytes": chunk_bytes,
               "region_bytes": region_bytes}
        if mixed:
            out.update(_mixed_rates(store, regions, src, dst, region_bytes))
    return out


def _mixed_rates(store: SsdStateStore, regions: dict[int, int], src: torch.Tensor, dst: torch.Tensor,
                 region_bytes: int) -> dict[str, float]:
    """Reads of the written regions and rewrites of them, all in flight together -- what an SSD
    step does when a layer's state is read ahead while the previous layer's is written back.

    One drive serves both in turn, so each rate falls below its solo rate; ``mixed_gbps`` (read +
    written bytes over the wall time) is the drive's throughput under that load, and
    (read bytes + written bytes) / ``mixed_gbps`` the I/O floor of such a step on it."""
    keys = sorted(regions)
    done: dict[str, float] = {}
    t0 = time.perf_counter()
    reads, writes = [], []
    for i, k in enumerate(keys):  # interleaved, so the store's queue holds both kinds at every moment
        (reads.append(store.read_async(k, dst)) if i % 2 == 0 else writes.append(store.write_async(k, src)))
    store.wait(reads)
    done["read"] = time.perf_counter() - t0
    store.wait(writes)
    store.sync()
    done["write"] = time.perf_counter() - t0
    nread, nwrite = len(reads) * region_bytes, len(writes) * region_bytes
    return {"mixed_read_gbps": nread / done["read"] / 1e9, "mixed_write_gbps": nwrite / done["write"] / 1e9,
            "mixed_gbps": (nread + nwrite) / max(done.values()) / 1e9}
