"""The plan search's option lists: packings, micro-batch sizes, stash placements, which resident
layers to step on the GPU. Pure functions of the model's shape; :mod:`tinypipe.planner.search`
evaluates every combination."""

from __future__ import annotations

from typing import Sequence

from tinypipe.planner.sizes import ModelSizes
from tinypipe.planner.work import REFERENCE_TOKENS
from tinypipe.schedule.plan import DeviceOptimizer, StashPlace

MAX_UNIFORM_PACK = 8
#: the largest k whose front split ((1,)*(k+1) + packs of k) is searched: the splits measured are
#: k = 2 and 3, and each one more costs ~5 % more plans priced
FRONT_SPLIT_MAX_PACK = 3
WINDOWS = (1, 2, 3)


def pack_options(num_blocks: int, max_uniform: int = MAX_UNIFORM_PACK) -> list[int | tuple[int, ...]]:
    """Uniform pack sizes 1..max (remainder last, as ``split_packs``) and a few uneven packings:
    the remainder first, a first pack of one block (pack 0's optimizer steps are the exposed
    tail of the step, so a small first pack shortens it), and k+1 single blocks before packs of k
    (the host lane's last packs then arrive a block at a time; measured a little faster than a
    first pack of one, as predicted: docs/measured.md)."""
    L = num_blocks
    out: list[int | tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()

    def add(sizes: tuple[int, ...], as_int: int | None = None) -> None:
        if sizes in seen or not sizes or min(sizes) < 1 or sum(sizes) != L:
            return
        seen.add(sizes)
        out.append(as_int if as_int is not None else sizes)

    def uniform(k: int, n: int) -> tuple[int, ...]:
        return tuple([k] * (n // k) + ([n % k] if n % k else []))

    for k in range(1, min(max_uniform, L) + 1):
        add(uniform(k, L), k)
    for k in range(2, min(max_uniform, L) + 1):
        if L % k:
            add(tuple([L % k] + [k] * (L // k)))
        if L > k:
            add((1,) + uniform(k, L - 1))
        if k <= FRONT_SPLIT_MAX_PACK and L > 2 * k + 1:
            add((1,) * (k + 1) + uniform(k, L - k - 1))
    return out


def micro_batch_options(batch: int) -> list[int]:
    """Divisors of the batch and powers of two up to it."""
    opts = {d for d in range(1, batch + 1) if batch % d == 0}
    p = 1
    while p <= batch:
        opts.add(p)
        p *= 2
    return sorted(opts)


def stash_options(num_packs: int) -> list[StashPlace | tuple[StashPlace, ...]]:
    """All on the device, all in host memory, and host for the first k pack inputs (the longest
    lived on the device) for k around a quarter, half and three quarters of the packs."""
    out: list[StashPlace | tuple[StashPlace, ...]] = ["device"]
    if num_packs > 1:
        out.append("host")
    ks = sorted({k for k in (num_packs // 4, num_packs // 2, (3 * num_packs) // 4) if 0 < k < num_packs - 1})
    for k in ks:
        out.append(tuple(["device"] + ["host"] * k + ["device"] * (num_packs - k)))
    return out


def device_optimizer_options(sizes: ModelSizes) -> tuple[DeviceOptimizer, ...]:
    """Resident-layer choices worth comparing: off, the embedding, and (untied) the head or both.
    Under LoRA a frozen embedding/head has nothing to step."""
    trains = sizes.layer_train_numels
    out: list[DeviceOptimizer] = ["off"]
    if trains[0]:
        out.append("embed")
    if trains[-1] and not sizes.tied:
        out.append("head")
        if trains[0]:
            out.append("both")
    return tuple(out)


def useful_micro_batches(options: Sequence[int], all_mbs: Sequence[int], seq: int,
                         plateau: float = REFERENCE_TOKENS) -> list[int]:
    """Micro-batch sizes worth trying: one whose half is also an option and already reaches the
    cost model's efficiency plateau (``plateau`` tokens) is never faster, only larger."""
    keep = []
    for m in sorted(set(options)):
        if m % 2 == 0 and m // 2 in all_mbs and (m // 2) * seq >= plateau:
            continue
        keep.append(m)
    return keep
