"""Random numbers that the backward's recompute replays exactly (dropout in training mode).

Forward runs without autograd and backward recomputes each pack, so whatever the forward drew
(dropout masks, SDPA's attention dropout, PEFT's ``lora_dropout``) the recompute must draw
again, bit for bit. (A pack that keeps its activations, ``Plan.keep_activations``, records its
graph in the forward: the masks live in it and nothing is replayed. Its forward is seeded the
same way, so its masks are the ones a recompute would have drawn.) As ``torch.utils.checkpoint``
does, the generator a task's model code draws from is put into a known state before the forward
and into the same state before the recompute.
Two differences, both because tinypipe runs several compute lanes in one process:

* The state is *set*, from a seed derived from ``(base seed, step, stage, forward
  micro-batch)``, rather than saved from wherever the running generator happened to be. Lanes of
  CPU devices (and device entries naming the same GPU) share one generator; saved states would
  depend on which lane drew first. Derived states make the masks independent of thread timing
  and of the number of devices, reproducible after ``--resume`` (the step count is restored),
  and computable by a reference implementation (tests/test_dropout.py).
* A task holds its generator for its whole compute (a lock per generator), so no other lane
  draws in between; afterwards the generator's previous state is restored, so the engine's draws
  never shift the user's own random stream.

Which generator: the CPU generator for CPU devices, the device's own generator for CUDA devices
(dropout on a CUDA tensor draws only from it; Inductor's compiled random ops seed themselves
from it as well). The lock serialises only lanes sharing a generator: on CUDA, one per GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from typing import Iterator

import torch

#: Stage names in seed keys.
EMBED, PACK, HEAD = "embed", "pack", "head"


def derive_seed(base: int, step: int, *key: int | str) -> int:
    """The 63-bit seed of one task's generator state: a hash, so that nearby keys do not give
    related streams (a sum like base + step would collide across steps and packs)."""
    text = ":".join(str(k) for k in ("tinypipe-rng", int(base), int(step), *key))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


def generator_of(device: torch.device) -> torch.Generator:
    """The default generator that model code running on ``device`` draws from."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()  # default_generators is empty before CUDA is initialised
        return torch.cuda.default_generators[index]
    if device.type == "cpu":
        return torch.default_generator
    raise ValueError(f"no replayable generator for device type {device.type!r}")


class TaskRng:
    """One task's hold on its device's generator: :meth:`seed` before each forward (or replayed
    recompute) of a stage, :meth:`drew` afterwards to learn whether it drew anything."""

    def __init__(self, generator: torch.Generator, base: int, step: int) -> None:
        self._gen = generator
        self._base = base
        self._step = step
        self._seeded: torch.Tensor | None = None

    def seed(self, *key: int | str) -> None:
        self._gen.manual_seed(derive_seed(self._base, self._step, *key))
        self._seeded = self._gen.get_state()

    def drew(self) -> bool:
        """Whether anything was drawn since the last :meth:`seed` (False before any seed)."""
        return self._seeded is not None and not torch.equal(self._gen.get_state(), self._seeded)


class DropoutRng:
    """The engine's replayable random state: the base seed and one lock per generator."""

    def __init__(self, base_seed: int) -> None:
        self.base_seed = int(base_seed)
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    @classmethod
    def from_seed(cls, seed: int | None) -> "DropoutRng":
        """``seed``, or (None) one drawn from torch's global CPU generator: ``torch.manual_seed``
        before building the engine makes the masks reproducible, as in Hugging Face's Trainer."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        return cls(seed)

    def _lock(self, generator: torch.Generator) -> threading.Lock:
        key = str(generator.device)
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    @contextlib.contextmanager
    def task(self, device: torch.device, step: int) -> Iterator[TaskRng]:
        """Hold ``device``'s generator for one task of optimizer step ``step``; its previous
        state is restored on exit."""
        gen = generator_of(device)
        with self._lock(gen):
            saved = gen.get_state()
            try:
                yield TaskRng(gen, self.base_seed, step)
            finally:
                gen.set_state(saved)


def replay_pieces(fwd_rows: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``(m, a, b)`` for every forward micro-batch ``m`` (rows ``a:b``) overlapping rows ``lo:hi``.

    A recompute reproduces a forward's draws only over the same rows: a backward micro-batch
    recomputes each overlapping forward micro-batch whole, under that micro-batch's seed, and
    keeps its own rows (backward micro-batches smaller than the forward's cost extra recompute).
    """
    return [(m, a, b) for m, (a, b) in enumerate(fwd_rows) if a < hi and b > lo]
