"""The search's second passes (:func:`tinypipe.planner.search.plan`): its fastest plans grown
with resident packs (:func:`with_resident_packs`), kept activations (:func:`with_kept_activations`,
:func:`keep_all`) and a micro-batch-wise turn (:func:`with_turn`), each variant kept while it fits.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from tinypipe.errors import ConfigError
from tinypipe.planner.candidate import Candidate
from tinypipe.planner.spill import Evaluate
from tinypipe.schedule.plan import Plan


#: Pareto plans (fastest first) that the search tries again with resident packs.
RESIDENT_SEEDS = 4


def with_resident_packs(seeds: list[Candidate], evaluate_plan: Evaluate,
                        settle: Callable[[Candidate], Candidate | None],
                        gpu_mem: int) -> tuple[list[Candidate], list[Candidate]]:
    """Each seed plan with 1, 2, ... of its first packs kept resident on the GPU (stepped there),
    for as long as that fits and its pack placement allows it (one device per resident pack):
    (every plan evaluated, those that fit -- ``settle`` fits the host, moving state to the SSD).

    Resident packs trade GPU memory (18 bytes per parameter in bf16: weights, fp32 gradient,
    master and moments) for link traffic and host AdamW work; the first packs come first because
    their host updates are the ones left after the backward."""
    out, fits = [], []
    for seed in seeds:
        peaks = [seed.memory.devices[n]["activations_peak"] for n in seed.memory.devices]
        for r in range(1, seed.plan.num_packs + 1):
            try:
                plan = dataclasses.replace(seed.plan, resident_packs=r, offload=(), assisted=())
            except ConfigError:  # this pack's forward and backward run on different devices
                break
            c = evaluate_plan(plan, peaks)
            out.append(c)
            settled = settle(c) if c.gpu_need <= gpu_mem else None
            if settled is None:
                break
            fits.append(settled)
    return out, fits


#: Pareto plans (fastest first, among those whose packs can keep activations) tried with them.
KEEP_SEEDS = 12


def with_kept_activations(seeds: list[Candidate], evaluate_plan: Evaluate,
                          settle: Callable[[Candidate], Candidate | None], gpu_mem: int,
                          saved_per_byte: Callable[[Plan], list[float]], grow_resident: bool,
                          streamed: bool = True) -> tuple[list[Candidate], list[Candidate]]:
    """Each seed plan with activations kept on the GPU, greedily: first the seed's keepable packs
    (:meth:`Plan.keepable_packs`: every pack on one device; with ``streamed`` False only the
    resident packs and the last pack across the turn) in order of
    recompute seconds saved per byte held (``saved_per_byte``), each added while the plan still
    fits and skipped when it does not (a smaller pack may); then (``grow_resident``) one more
    resident pack at a time, kept too, for as long as that fits: (every plan evaluated, those
    that fit).

    A kept pack holds its whole step's activations (every forward micro-batch) on the GPU from its
    forward to its backward and is not recomputed: one forward of its FLOPs less per step. A
    streamed pack's graph re-reads its weights from the backward's slots (runtime/weight_refs.py),
    so any pack can keep; a QLoRA base's cannot, and there keeping more than the last pack means
    making packs resident (18 bytes per parameter in bf16 on top of their activations)."""
    out: list[Candidate] = []
    fits: list[Candidate] = []
    fitting = _fitter(evaluate_plan, settle, gpu_mem, out, fits)

    for seed in seeds:
        plan = dataclasses.replace(seed.plan, assisted=())  # settle chooses them again for each variant
        if plan.backward_micro_batch_size % plan.micro_batch_size:
            continue
        ratio = saved_per_byte(plan)
        keep: set[int] = set()
        for q in sorted(plan.keepable_packs(streamed), key=lambda q: -ratio[q]):
            if fitting(trial := _keeping(plan, keep | {q})) is not None:
                keep.add(q)
                plan = trial
        for r in range(plan.resident_packs + 1, plan.num_packs + 1) if grow_resident else ():
            try:
                trial = _keeping(dataclasses.replace(plan, resident_packs=r, offload=()), keep | {r - 1})
            except ConfigError:  # this pack's forward and backward run on different devices
                break
            if fitting(trial) is None:
                break
            keep.add(r - 1)
            plan = trial
    return out, fits


def _fitter(evaluate_plan: Evaluate, settle: Callable[[Candidate], Candidate | None], gpu_mem: int,
            out: list[Candidate], fits: list[Candidate]) -> Callable[[Plan], Candidate | None]:
    """Evaluate a plan into ``out`` and, settled on the host when it fits the GPU, into ``fits``:
    returns the settled candidate (None: it does not fit)."""

    def fitting(plan: Plan) -> Candidate | None:
        c = evaluate_plan(plan, None)
        out.append(c)
        settled = settle(c) if c.gpu_need <= gpu_mem else None
        if settled is not None:
            fits.append(settled)
        return settled

    return fitting


#: Pareto plans (fastest first, after keeping) tried with a micro-batch-wise turn. Four missed the
#: W1 plan measured fastest (21,514 tok/s at 214e2e1: one resident pack, a turn through four) for
#: one predicted slower and 1.3 GiB larger (~21,100 at cee9907aabd5); eight find it again, in about
#: the same planning time.
TURN_SEEDS = 8


def with_turn(seeds: list[Candidate], evaluate_plan: Evaluate,
              settle: Callable[[Candidate], Candidate | None], gpu_mem: int,
              saved_per_byte: Callable[[Plan], list[float]],
              streamed: bool = True) -> tuple[list[Candidate], list[Candidate]]:
    """Each seed plan with a micro-batch-wise turn (``Plan.turn_packs``) through its last 1, 2, ...
    packs for as long as that fits, then (the longest turn that fits) its other packs kept greedily
    as :func:`with_kept_activations` keeps them: (every plan evaluated, those that fit).

    A pack in the turn is not recomputed and holds one forward micro-batch's graph instead of the
    step's, but the turn's weights and gradient accumulators are all on the device at once (its
    slots), and no host AdamW starts before the turn is through (the time model's terms)."""
    out: list[Candidate] = []
    fits: list[Candidate] = []
    fitting = _fitter(evaluate_plan, settle, gpu_mem, out, fits)

    for seed in seeds:
        base = dataclasses.replace(seed.plan, assisted=(), turn_packs=0)
        kept = {q for q in range(base.num_packs) if base.kept(q)}
        longest: Candidate | None = None
        for k in range(1, base.num_packs - base.resident_packs + 1):
            try:
                turn = set(range(base.num_packs - k, base.num_packs))
                trial = dataclasses.replace(_keeping(base, kept | turn), turn_packs=k)
            except ConfigError:  # the turn's packs would run on other devices than the head
                break
            if (settled := fitting(trial)) is None:
                break
            longest = settled
        if longest is not None:
            more, more_fits = with_kept_activations([longest], evaluate_plan, settle,
                                                    gpu_mem, saved_per_byte, grow_resident=False,
                                                    streamed=streamed)
            out += more
            fits += more_fits
    return out, fits


def _keeping(plan: Plan, kept: set[int]) -> Plan:
    """``plan`` with the activations of packs ``kept`` (and the turn's, ``Plan.turn_packs``) kept,
    their inputs stashed on the device: a kept pack's backward reads no stash, so a host stash
    would only move its input down and up again in the forward -- on the device it costs about
    what the graphs would hold of it anyway."""
    kept = kept | set(plan.turn())
    stash = tuple(h and q not in kept for q, h in enumerate(plan.stash_on_host))
    return dataclasses.replace(plan, keep_activations=tuple(q in kept for q in range(plan.num_packs)),
                               stash_on_host=stash)


def keep_all(fits: list[Candidate], evaluate_plan: Evaluate, settle: Callable[[Candidate], Candidate | None],
             gpu_mem: int, streamed: bool = True) -> tuple[list[Candidate], list[Candidate]]:
    """``keep_activations=True``: every plan that can keep them, with every keepable pack kept."""
    out, kept = [], []
    for c in fits:
        p = dataclasses.replace(c.plan, assisted=())  # settle chooses them again
        if not p.keepable_packs(streamed) or p.backward_micro_batch_size % p.micro_batch_size:
            continue
        trial = evaluate_plan(_keeping(p, set(p.keepable_packs(streamed))), None)
        out.append(trial)
        settled = settle(trial) if trial.gpu_need <= gpu_mem else None
        if settled is not None:
            kept.append(settled)
    return out, kept
