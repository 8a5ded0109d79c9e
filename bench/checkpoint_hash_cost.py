"""What the checkpoint checksums cost (#34): the layer-file loop of ``runtime/checkpoint.py`` (save_file
+ fsync per layer) over ``--layers`` files of ``--mib`` MiB each, without hashing and with each file
hashed in the background thread while the next is written (``runtime/checksums.py``), and the
hash rate alone. Run: ``python bench/checkpoint_hash_cost.py --dir /path/on/the/disk``."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tinypipe.runtime.checksums import BackgroundHasher, sha256_file  # noqa: E402


def write_all(where: Path, tensors: dict[str, torch.Tensor], layers: int, hash_: bool) -> float:
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir()
    t0 = time.perf_counter()
    with BackgroundHasher() as hasher:
        for i in range(layers):
            path = where / f"layer-{i:04d}.safetensors"
            save_file(tensors, str(path))
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            if hash_:
                hasher.submit(path)
        hasher.digests()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--mib", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    n = a.mib * 2**20 // 4 // 3
    tensors = {k: torch.randn(n) for k in ("master", "exp_avg", "exp_avg_sq")}
    where = Path(tempfile.mkdtemp(dir=a.dir, prefix="hash-cost-"))
    try:
        total = a.layers * a.mib / 1024
        for hash_ in (False, True, False, True)[: 2 * a.repeat]:
            s = write_all(where / "c", tensors, a.layers, hash_)
            print(f"{'hashed' if hash_ else 'plain '}: {total:.2f} GiB in {s:.2f} s ({total / s:.2f} GiB/s)")
        t0 = time.perf_counter()
        for p in sorted((where / "c").iterdir()):
            sha256_file(p)
        s = time.perf_counter() - t0
        print(f"sha256 alone (page cache): {total:.2f} GiB in {s:.2f} s ({total / s:.2f} GiB/s)")
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
