"""Sweep the SSD tier's I/O path over worker threads and request (chunk) sizes.

Usage: ``python bench/archive/ssd_rates.py DIR [--gib 1] [--reps 2] [--threads 1,2,4,8,16]
[--chunks-mib 4,16,64] [--json OUT.json]``

Each configuration writes then reads ``--gib`` GiB through :func:`tinypipe.storage.measure_rates`
(O_DIRECT, all requests in flight, flush included in the write), interleaving the repetitions so
that a noisy neighbour does not bias one configuration. A buffered (no O_DIRECT) run at the
default setting is added for comparison. Every measurement is one row of the JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from tinypipe.storage import measure_rates  # noqa: E402
from tinypipe.storage.scratch import filesystem_type  # noqa: E402
from tinypipe.storage.store import DEFAULT_CHUNK_BYTES, DEFAULT_THREADS  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=_ints, default=[1, 2, 4, 8, 16])
    ap.add_argument("--chunks-mib", type=_ints, default=[4, 16, 64])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    nbytes = int(args.gib * 2**30)
    rows = []
    configs = [(t, c << 20, True) for c in args.chunks_mib for t in args.threads]
    configs.append((DEFAULT_THREADS, DEFAULT_CHUNK_BYTES, False))
    for rep in range(args.reps):
        for threads, chunk, direct in configs:
            cpu = time.process_time()
            r = measure_rates(args.directory, nbytes, threads=threads, chunk_bytes=chunk, direct=direct)
            cpu = time.process_time() - cpu  # includes filling the 64 MiB source buffer once
            r.update(rep=rep, requested_direct=direct, time=time.time(),
                     cpu_s_per_gb=cpu / (2 * r["nbytes"] / 1e9))
            rows.append(r)
            print(f"rep {rep} threads {threads:2d} chunk {chunk >> 20:3d} MiB direct {r['direct']!s:5}: "
                  f"read {r['read_gbps']:.2f} GB/s, write {r['write_gbps']:.2f} GB/s, "
                  f"CPU {r['cpu_s_per_gb']:.3f} s/GB", flush=True)
    ldconfig = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    meta = {"host": platform.node(), "filesystem": filesystem_type(args.directory), "nbytes": nbytes,
            "libaio": "libaio" in ldconfig, "python": platform.python_version()}
    print("median over repetitions (read, write GB/s):")
    for threads, chunk, direct in configs:
        same = [r for r in rows
                if (r["threads"], r["chunk_bytes"], r["requested_direct"]) == (threads, chunk, direct)]
        med = {k: statistics.median(r[k] for r in same) for k in ("read_gbps", "write_gbps", "cpu_s_per_gb")}
        print(f"  threads {threads:2d} chunk {chunk >> 20:3d} MiB direct {direct!s:5}: "
              f"{med['read_gbps']:.2f}, {med['write_gbps']:.2f} (CPU {med['cpu_s_per_gb']:.3f} s/GB)")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
