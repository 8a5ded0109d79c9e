"""Read and write rates of offload directories, measured the way the SSD tier moves state.

``tinypipe profile --offload-dir DIR`` records them for the planner: a step that keeps S bytes of
state on the SSD reads and writes S, so these two numbers bound the step time from below. With
several directories (``--offload-dir A,B``, one per drive) the planner's rates are those of the
striped set, measured with all of them at once (:func:`measure_directories`): that is what the
engine's store does, and it shows what the drives' shared bus, controller or CPU leave of the sum.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch

from tinypipe.errors import StorageError
from tinypipe.devices.host_buffers import aligned_empty
from tinypipe.storage.store import DEFAULT_CHUNK_BYTES, DEFAULT_THREADS, SsdStateStore
from tinypipe.storage.stripe import as_directories, describe

Directories = str | os.PathLike | Sequence[str | os.PathLike]

#: Size of each measured request (one layer's state is tens to hundreds of MiB).
REGION_BYTES = 64 << 20


def measure_rates(directory: Directories, nbytes: int = 1 << 30, *, threads: int = DEFAULT_THREADS,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES, region_bytes: int = REGION_BYTES,
                  direct: bool = True, mixed: bool = False) -> dict[str, float | int | bool]:
    """Write then read ``nbytes`` through an :class:`SsdStateStore` in a scratch file under
    ``directory`` (removed afterwards), all requests in flight at once; returns ``read_gbps``,
    ``write_gbps`` (1e9 bytes/s, the write including the final flush), ``direct`` and the setup.
    Several directories: one store striped over them (``threads`` workers each), the rates the
    set's (``direct``: every directory took O_DIRECT).

    Host memory: two buffers of ``region_bytes``. The data is random (a compressing SSD would
    flatter zeros) and regions covering every directory are read back and compared, so a broken
    path cannot report a rate.
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
        per_region = -(-region_bytes // chunk_bytes)  # chunks, on consecutive drives
        for k in list(regions)[-min(len(regions), -(-len(store.paths) // per_region)):]:  # every drive
            dst.zero_()
            store.read(k, dst)
            if not torch.equal(dst, src):
                raise StorageError(f"offload directory {describe(directory)}: data read back differs from "
                                   "what was written")
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


def measure_directories(directories: Directories, nbytes: int = 1 << 30, *, mixed: bool = True,
                        log: Callable[[str], None] | None = None, **options: int | bool) -> dict:
    """:func:`measure_rates` of one directory, or of each of several alone (``nbytes`` each) and
    then of all of them striped (``nbytes`` each again, ``len * nbytes`` in all): the striped
    set's rates at the top level (what the planner uses), each directory's under
    ``"directories"``. ``directory`` is the path, or the list of them; ``log`` gets one line per
    measurement."""
    dirs = as_directories(directories)
    runs: list[dict] = []
    for d in dirs if len(dirs) > 1 else ():
        runs.append(dict(measure_rates(d, nbytes, mixed=mixed, **options), directory=d))
        if log:
            log(rate_line(d, runs[-1]))
    whole = measure_rates(dirs if len(dirs) > 1 else dirs[0], nbytes * len(dirs), mixed=mixed, **options)
    out = dict(whole, directory=dirs[0] if len(dirs) == 1 else list(dirs))
    if runs:
        out["directories"] = runs
    if log:
        log(rate_line(f"{describe(dirs)} striped" if runs else dirs[0], out))
    return out


def rate_line(where: str, r: dict) -> str:
    """``DIR: SSD read 1.30 GB/s, write 2.30 GB/s, both at once 1.85 GB/s (0.92 + 0.93)``."""
    text = f"{where}: SSD read {r['read_gbps']:.2f} GB/s, write {r['write_gbps']:.2f} GB/s"
    if "mixed_gbps" in r:
        text += (f", both at once {r['mixed_gbps']:.2f} GB/s ({r['mixed_read_gbps']:.2f} read + "
                 f"{r['mixed_write_gbps']:.2f} write)")
    return text + ("" if r["direct"] else " (buffered: the filesystem refused O_DIRECT)")
