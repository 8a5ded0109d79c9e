#!/usr/bin/env python3
"""One assisted update's round trip alone, against the link it runs on (#16).

Session 8's traced W1 clipped step (``s8_w1_clip_assist_s8.trace.json``) showed each assisted
block's upload taking ~48 ms where the planner's race assumed ~30 ms (1.61 GB up, 1.21 GB down, a
both-directions link of 101 GB/s): the next forward waited on the link. This times, for one layer
of ``--numel`` fp32 parameters (default: a W1 block), with CUDA events on the streams:

* ``master up``: the plain upload every layer makes (4 B/param);
* ``copies only``: the round trip's chunked copies (master, moments and gradient up, master and
  moments down, the same ring of chunk buffers) with no step -- the ceiling of the pattern;
* ``round trip``: :meth:`AssistedUpdates._round_trip` as the runtime calls it for a clipped
  step's assisted update (step on the upload stream, the cast into a compute-precision slot);
  and the same with the step count made as it was before session 9 (a blocking pageable copy
  per fused call);
* the round trip beside a host AdamW pass (``--host-numel`` parameters, fused, all cores), which
  is what runs beside it in a clipped step: both times, and the host pass's rate alone.

    python bench/archive/assist_roundtrip.py --json out.json     # on the GPU machine (~1 min)

Prints a table last: ms, GB/s of the bytes each moves, and the ratio to ``copies only``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from types import SimpleNamespace

import torch
import torch.optim.adamw as _adamw

from tinypipe.devices.backend import HostPinner, make_backend
from tinypipe.devices.host_buffers import aligned_empty, registrable
from tinypipe.memory.device_pool import ASSIST_BUFFERS, ASSIST_CHUNK_NUMEL
from tinypipe.memory.host_store import LayerState
from tinypipe.models.decompose import LayerKind, LayerSpec
from tinypipe.runtime.optim.adamw import ChunkedAdamW
from tinypipe.runtime.optim.assist import AssistedUpdates

W1_BLOCK_NUMEL = 100_669_440  # Llama-3.2-3B decoder layer (hidden 3072, MLP 8192, 8 KV heads)


def _host(n: int, fill: float, pinner: HostPinner | None = None) -> torch.Tensor:
    t = aligned_empty(n)
    t.fill_(fill)
    if pinner is not None:
        pinner.pin(registrable(t))
    return t


class _BlockingSteps(ChunkedAdamW):
    """The device step as it was before this bench: the step count made with
    ``torch.tensor(x, device=cuda)``, a pageable copy that blocks the calling thread until the
    stream's queued work is done. Emulated by one such copy ahead of each fused call."""

    def _fused(self, state, runs, lo, grad, step, lr, weight_decay, grad_scale, found_inf=None) -> None:
        torch.tensor(float(step - 1), device=state.master.device)
        super()._fused(state, runs, lo, grad, step, lr, weight_decay, grad_scale, found_inf)


def _timed(fn, reps: int) -> float:
    """Median ms of ``fn()`` over ``reps`` runs after a first one, each until the device is idle."""
    out = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out[1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=W1_BLOCK_NUMEL)
    ap.add_argument("--host-numel", type=int, default=400_000_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("assist_roundtrip.py needs a CUDA device")
    n = args.numel
    be = make_backend("cuda:0")
    dev_t = be.device
    pinner = HostPinner(True)
    spec = LayerSpec(index=0, kind=LayerKind.BLOCK, name="block", params=[], numel=n)
    # master and gradient pinned here, the moments by AssistedUpdates (as in the engine)
    state = LayerState(spec=spec, master=_host(n, 0.01, pinner), exp_avg=_host(n, 1e-4),
                       exp_avg_sq=_host(n, 1e-6))
    grad = _host(n, 1e-3, pinner)
    store = SimpleNamespace(layers={0: state})
    adamw = ChunkedAdamW(1e-5, (0.9, 0.999), 1e-8, 0.0)
    assist = AssistedUpdates(store, adamw, [0], lambda layer: grad, pinner.pin)
    blocking = AssistedUpdates(store, _BlockingSteps(1e-5, (0.9, 0.999), 1e-8, 0.0), [0], lambda layer: grad,
                               None)
    streams = {name: be.new_stream() for name in ("h2d", "d2h", "collective")}
    bufs = [torch.empty(4, ASSIST_CHUNK_NUMEL, dtype=torch.float32, device=dev_t) for _ in range(ASSIST_BUFFERS)]
    dev = SimpleNamespace(index=0, backend=be, streams=streams, pool=SimpleNamespace(assist=bufs), device=dev_t)
    slot = torch.empty(n, dtype=torch.bfloat16, device=dev_t)
    staging = torch.empty(n, dtype=torch.float32, device=dev_t)

    def master_up() -> None:
        with torch.cuda.stream(streams["h2d"]):
            staging.copy_(state.master, non_blocking=True)

    def copies_only() -> None:
        h2d, d2h = streams["h2d"], streams["d2h"]
        free: list[object | None] = [None] * len(bufs)
        for i, lo in enumerate(range(0, n, ASSIST_CHUNK_NUMEL)):
            hi = min(n, lo + ASSIST_CHUNK_NUMEL)
            k = i % len(bufs)
            be.wait_event(h2d, free[k])
            p, m, v, g = (row[: hi - lo] for row in bufs[k])
            with torch.cuda.stream(h2d):
                for dst, src in ((p, state.master), (m, state.exp_avg), (v, state.exp_avg_sq), (g, grad)):
                    dst.copy_(src[lo:hi], non_blocking=True)
                up = be.record_event(h2d)
            be.wait_event(d2h, up)
            with torch.cuda.stream(d2h):
                for src, dst in ((p, state.master), (m, state.exp_avg), (v, state.exp_avg_sq)):
                    dst[lo:hi].copy_(src, non_blocking=True)
                free[k] = be.record_event(d2h)

    def round_trip(updates: AssistedUpdates = assist) -> None:
        h2d = streams["h2d"]
        with torch.cuda.stream(h2d):
            scale = torch.full((), 1.25, dtype=torch.float32, device=dev_t)
            updates._round_trip(0, dev, h2d, h2d, 5, 1e-5, host_grad=grad, dst=slot, grad_scale=scale,
                                extra=(0, 0))

    hn = args.host_numel
    hp, hg, hm, hv = (torch.full((hn,), x) for x in (0.01, 1e-3, 1e-4, 1e-6))

    def host_pass() -> float:
        t0 = time.perf_counter()
        _adamw.adamw([hp], [hg], [hm], [hv], [], [torch.tensor(4.0)], fused=True, grad_scale=None,
                     amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-5, weight_decay=0.0, eps=1e-8, maximize=False)
        return time.perf_counter() - t0

    rows = []
    bytes_rt = n * 4 * 7  # 4 tensors up, 3 down
    for label, fn, nbytes in (("master up", master_up, 4 * n), ("copies only", copies_only, bytes_rt),
                              ("round trip", round_trip, bytes_rt),
                              ("round trip, blocking step count (before)", lambda: round_trip(blocking), bytes_rt)):
        ms = _timed(fn, args.reps)
        rows.append({"run": label, "ms": ms, "gbs": nbytes / ms / 1e6})
    host_alone = statistics.median(host_pass() for _ in range(3))
    rows.append({"run": f"host AdamW alone ({hn / 1e6:.0f} M params)", "ms": host_alone * 1e3,
                 "gparams_s": hn / host_alone / 1e9})

    # the round trip (or its copies alone) looped beside host passes, at two intra-op thread counts
    threads = torch.get_num_threads()
    for label, fn in (("round trip", round_trip), ("copies only", copies_only)):
        for t in sorted({threads, max(1, threads - 4)}, reverse=True):
            torch.set_num_threads(t)
            trips: list[float] = []
            done = threading.Event()

            def trip_loop(fn=fn, trips=trips, done=done) -> None:
                while not done.is_set():
                    trips.append(_timed(fn, 1))

            worker = threading.Thread(target=trip_loop)
            worker.start()
            time.sleep(0.05)
            beside = statistics.median(host_pass() for _ in range(3))
            done.set()
            worker.join()
            rows.append({"run": f"{label} beside the host pass ({t} threads)", "ms": statistics.median(trips),
                         "gbs": bytes_rt / statistics.median(trips) / 1e6, "trips": len(trips)})
            rows.append({"run": f"host AdamW beside {label}s ({t} threads)", "ms": beside * 1e3,
                         "gparams_s": hn / beside / 1e9})
    torch.set_num_threads(threads)
    ref = rows[1]["ms"]
    print(f"layer of {n / 1e6:.1f} M fp32 params, chunks of {ASSIST_CHUNK_NUMEL} x {ASSIST_BUFFERS} buffers, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    print(f"{'run':50s} {'ms':>8s} {'GB/s':>7s} {'G par/s':>8s} {'/copies':>8s}")
    for r in rows:
        gbs = f"{r['gbs']:7.1f}" if "gbs" in r else " " * 7
        gp = f"{r['gparams_s']:8.2f}" if "gparams_s" in r else " " * 8
        rel = f"{r['ms'] / ref:8.2f}" if "gbs" in r else ""
        print(f"{r['run']:50s} {r['ms']:8.2f} {gbs} {gp} {rel}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": n, "chunk_numel": ASSIST_CHUNK_NUMEL, "buffers": ASSIST_BUFFERS,
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
    pinner.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
