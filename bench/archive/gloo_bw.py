#!/usr/bin/env python3
"""gloo all-reduce bandwidth between processes on one machine -- the bound of replicas that share
a GPU (NCCL refuses two ranks on one GPU, so their gradients go through gloo).

    python -m torch.distributed.run --nproc-per-node 2 bench/archive/gloo_bw.py [--mb 400] [--reps 3]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=400, help="fp32 tensor size in MB (1e6 bytes)")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    t = torch.ones(a.mb * 250_000)
    for _ in range(a.reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        dt = time.perf_counter() - t0
        if dist.get_rank() == 0:
            print(f"all_reduce {a.mb} MB over {dist.get_world_size()} ranks: {dt:.2f} s  "
                  f"{a.mb / 1e3 / dt:.2f} GB/s (algbw)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
