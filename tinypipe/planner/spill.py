"""Fitting a plan into host memory with the SSD, and the global batch that hides the SSD's I/O.

The SSD tier's two decisions are made here only: whether it is on (:func:`ssd_tier_on`, and the
SSD planned for, :func:`ssd_for`) and which state of which layer goes to it (:func:`choose_spill`)
-- for the search's plans, a hand-set plan checked against the workload (both through
:class:`Spill`) and a hand-set plan without a workload (:mod:`tinypipe.planner.auto`).

:class:`Spill` takes each evaluated plan that fits the GPUs but not the host, moves state to the SSD
in the planner's order (:func:`tinypipe.planner.offload.choose_offload`) until the host need fits,
re-evaluates it (the step time then has the SSD lanes), and remembers why plans were refused --
too little DRAM even with everything on the SSD, or too little free disk -- for the one-line
message when nothing fits. Several offload directories are one SSD to it: their aggregate rates
and what they can hold together (:func:`tinypipe.planner.ssd.free_space`).

:func:`hiding_batch`: the bytes a step moves to and from the SSD do not grow with the batch, the
compute does. The smallest global batch at which the SSD costs under :data:`HIDDEN_SHARE` of the
step (against the same plan with an infinitely fast SSD), for the chosen plan's knobs, the offload
set re-chosen at each batch (a host stash grows with it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tinypipe.config import Config
from tinypipe.errors import PlanDoesNotFitError
from tinypipe.planner.candidate import HOST_BASELINE_BYTES, Candidate
from tinypipe.planner.cost import predict_step_time
from tinypipe.planner.estimate import store_and_beside
from tinypipe.planner.hardware import HardwareSpec
from tinypipe.planner.offload import choose_offload, disk_bytes, least_host_need
from tinypipe.planner.sizes import ModelSizes
from tinypipe.planner.ssd import SsdSpec, ssd_spec
from tinypipe.schedule.plan import Plan
from tinypipe.schedule.stash_places import host_memory_stashes
from tinypipe.units import gib_text

#: The SSD counts as hidden when the step is at most this much slower than with an infinitely fast one
#: (well inside the time model's own error: its calibration points are within 15 %).
HIDDEN_SHARE = 0.05
#: The largest global batch :func:`hiding_batch` tries (sequences).
MAX_HIDING_BATCH = 1 << 14

#: ``evaluate(plan, peaks)``: a plan's Candidate at the workload being planned.
Evaluate = Callable[[Plan, Sequence[int] | None], Candidate]
#: ``Plan.offload``: (layer, kind of state) on the SSD.
Offload = tuple[tuple[int, str], ...]


def ssd_tier_on(config: Config) -> bool:
    """Whether the plan may put training state on the SSD: an offload directory was given."""
    return config.offload_dir is not None


def ssd_for(config: Config, hw: HardwareSpec) -> SsdSpec | None:
    """The SSD the plan may use: ``Config.offload_dir`` at the hardware's rates (None: DRAM only;
    the engine never measures: the rates only rank plans, the offload set depends on the budget)."""
    if not ssd_tier_on(config):
        return None
    return ssd_spec(hw, directory=config.offload_dir)


def choose_spill(sizes: ModelSizes, plan: Plan, cats: dict[str, int], beside: int, cpu_mem: int, *,
                 precision: str, retain_grads: bool) -> tuple[Offload | None, int]:
    """Which state goes to the SSD so that ``plan`` fits ``cpu_mem`` of host memory: its DRAM-only
    host categories ``cats`` (those an offload moves) plus ``beside`` bytes that stay whatever moves.
    Returns ``(offload, 0)``, or ``(None, need)`` when even everything on the SSD leaves it ``need``
    bytes of host memory, more than it has."""
    kw = dict(precision=precision, retain_grads=retain_grads)
    offload = choose_offload(sizes, plan, cats, cpu_mem - beside, **kw)
    if offload is None:
        return None, least_host_need(sizes, plan, cats, **kw) + beside
    return offload, 0


class Spill:
    """Offload decisions for one search (``ssd`` None: DRAM only, plans that do not fit are refused)."""

    def __init__(self, sizes: ModelSizes, ssd: SsdSpec | None, cpu_mem: int, *, precision: str,
                 retain_grads: bool, mlp_chunk: int = 0) -> None:
        self.sizes, self.ssd, self.cpu_mem = sizes, ssd, cpu_mem
        self.precision, self.retain_grads = precision, retain_grads
        self.mlp_chunk = mlp_chunk  # the blocks' MLP chunk the plans run with (0: unchunked)
        self.least_host: Candidate | None = None  # refused: DRAM too small even with the SSD
        self.least_host_need = 0
        self.least_disk: int | None = None  # refused: the disk too small (bytes the smallest one needed)

    def settle(self, c: Candidate, evaluate: Evaluate) -> Candidate | None:
        """``c`` when it fits the host; else ``c`` with state on the SSD so that it does (None: it
        cannot, with the reason recorded)."""
        if c.host_need <= self.cpu_mem:
            return c
        if self.ssd is None:
            return None
        if c.plan.offload or c.plan.stash_on_ssd:  # choose from the DRAM-only categories (an offloaded
            peaks = [cats["activations_peak"] for cats in c.memory.devices.values()]  # plan's have moved)
            c = evaluate(dataclasses.replace(c.plan, offload=(), stash_on_ssd=()), peaks)
        cats, fixed = store_and_beside(c.memory)
        beside = HOST_BASELINE_BYTES + fixed  # host need beyond the categories an offload moves
        offload, need = choose_spill(self.sizes, c.plan, cats, beside, self.cpu_mem, precision=self.precision,
                                     retain_grads=self.retain_grads)
        each = 0  # bytes of one pack input stashed on the SSD (its scratch space)
        if offload is None and self.mlp_chunk > 0:  # long sequences: pack inputs to the SSD too
            c, offload, need, each = self._stash_to_ssd(c, evaluate, need)
            cats, fixed = store_and_beside(c.memory)
        if offload is None:
            if self.least_host is None or need < self.least_host_need:
                self.least_host, self.least_host_need = c, need
            return None
        disk = disk_bytes(self.sizes, offload, self.precision) + len(c.plan.stash_on_ssd) * each
        if self.ssd.free_bytes is not None and disk > self.ssd.free_bytes:
            self.least_disk = disk if self.least_disk is None else min(self.least_disk, disk)
            return None
        peaks = [cats["activations_peak"] for cats in c.memory.devices.values()]
        # a plan with state on the SSD assists nothing (tinypipe.planner.assist)
        out = evaluate(dataclasses.replace(c.plan, offload=offload, assisted=()), peaks)
        assert out.host_need <= self.cpu_mem, "choose_offload and host_bytes disagree"
        return out

    def _stash_to_ssd(self, c: Candidate, evaluate: Evaluate,
                      need: int) -> tuple[Candidate, Offload | None, int, int]:
        """When even all training state on the SSD leaves ``c`` ``need`` bytes of host memory: its
        host-stashed pack inputs to the SSD as well (``Plan.stash_on_ssd``), the earliest packs'
        first -- their backward comes last, so their read-back has the most time -- as few as make
        the rest fit (the state's offload re-chosen). Returns ``(candidate, offload, 0)``, or
        ``(candidate with every such input on the SSD, None, its least host need)``, each with the
        bytes of one input (``[B, S, H]``: its scratch space; the rows' page rounding aside)."""
        plan = c.plan
        movable = [q for q, on in enumerate(host_memory_stashes(plan, True))
                   if on and q > 0 and not plan.kept(q)]
        host = c.memory.host
        held = sum(host_memory_stashes(plan, True))
        if not movable or not held:
            return c, None, need, 0
        each = host.get("stashed_activations", 0) // held
        peaks = [cats["activations_peak"] for cats in c.memory.devices.values()]
        k = max(1, min(len(movable), -(-(need - self.cpu_mem) // max(1, each))))
        while True:
            moved = evaluate(dataclasses.replace(plan, stash_on_ssd=tuple(movable[:k]), offload=(),
                                                 assisted=()), peaks)
            cats, fixed = store_and_beside(moved.memory)
            offload, need = choose_spill(self.sizes, moved.plan, cats, HOST_BASELINE_BYTES + fixed,
                                         self.cpu_mem,
                                         precision=self.precision, retain_grads=self.retain_grads)
            if offload is not None or k == len(movable):
                return moved, offload, need, each
            k += 1

    def why_not(self) -> str | None:
        """One line for a search whose plans fit the GPUs but none fit host memory (None: no
        plan was refused by the SSD tier)."""
        if self.ssd is None:
            return None
        where = f" on {self.ssd.directory}" if self.ssd.directory else ""
        if self.least_disk is not None:
            free = gib_text(self.ssd.free_bytes or 0)
            several = isinstance(self.ssd.directory, tuple)
            disk = (f"the {len(self.ssd.directory)} directories can hold {free} (each its share)" if several
                    else f"the disk has {free} free")
            return (f"needs {gib_text(self.least_disk)} of SSD scratch space{where} to fit host memory "
                    f"under {gib_text(self.cpu_mem)}, {disk}; free space, choose another --offload-dir "
                    "or add RAM")
        if self.least_host is not None:
            host = self.least_host.memory.host
            n = len(self.least_host.plan.stash_on_ssd)
            inputs = "" if not n else f" and {n} pack input{'s' * (n > 1)}"
            return (f"needs {gib_text(self.least_host_need)} host memory even with its training "
                    f"state{inputs} "
                    f"on the SSD{where}, have {gib_text(self.cpu_mem)} (what stays: the staging pool, "
                    f"gradient pools, {gib_text(host.get('stashed_activations', 0))} of stashed activations "
                    "and the process); add RAM, try --lora or a smaller --global-batch")
        return None


@dataclass(frozen=True)
class IoHiding:
    """Where the SSD's I/O stops costing time for the chosen plan's knobs."""

    batch: int | None  # smallest global batch with the SSD hidden (None: not up to MAX_HIDING_BATCH)
    step_s: float | None = None
    tokens_per_s: float | None = None
    ssd_bytes: int = 0  # state on the SSD at that batch
    gpu_need: int | None = None
    host_need: int | None = None
    fits_gpu: bool = True  # the plan's knobs fit the GPUs at that batch
    note: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def hiding_batch(sizes: ModelSizes, hw: HardwareSpec, plan: Plan,
                 evaluate_at: Callable[[Plan, int], Candidate], spill: Spill, *, seq: int, precision: str,
                 gpu_mem: int) -> IoHiding:
    """The smallest global batch at which ``plan``'s knobs (its offload re-chosen for that batch)
    run with the SSD hidden (see the module documentation); doubling, then bisection."""
    fast = dataclasses.replace(hw, ssd_read_gbps=1e12, ssd_write_gbps=1e12)

    def at(batch: int) -> tuple[bool, Candidate | None]:
        c = evaluate_at(dataclasses.replace(plan, offload=()), batch)
        settled = spill.settle(c, lambda p, peaks: evaluate_at(p, batch))
        if settled is None:
            return False, None
        ideal = predict_step_time(sizes, settled.plan, fast, batch=batch, seq=seq, precision=precision,
                                  mlp_chunk=spill.mlp_chunk)
        return settled.time.step_s <= ideal.step_s * (1 + HIDDEN_SHARE), settled

    found, stop = _first_hidden(at, 0, 1, MAX_HIDING_BATCH, lambda hi: 1)
    if found is None:
        if stop is not None:
            return IoHiding(None, note=f"at {stop} sequences per step the host cannot hold what stays "
                                       "in DRAM")
        return IoHiding(None, note=f"not hidden up to {MAX_HIDING_BATCH} sequences per step")
    batch, c = found
    on_ssd = disk_bytes(sizes, c.plan.offload, precision)
    return IoHiding(batch, c.time.step_s, c.tokens_per_s, on_ssd, c.gpu_need, c.host_need,
                    fits_gpu=c.gpu_need <= gpu_mem)


def _first_hidden(at: Callable[[int], tuple[bool, Candidate | None]], lo: int, hi: int, limit: int,
                  resolution: Callable[[int], int]) -> tuple[tuple[int, Candidate] | None, int | None]:
    """Double ``hi`` from ``lo`` until ``at(batch)`` says hidden, then bisect down to within
    ``resolution(hi)``: ``((batch, candidate), None)``; ``(None, batch)`` when nothing fits at that
    doubling batch; ``(None, None)`` when not hidden up to ``limit``."""
    found = None
    while hi <= limit:
        hidden, c = at(hi)
        if c is None:
            return None, hi
        if hidden:
            found = (hi, c)
            break
        lo, hi = hi, 2 * hi
    if found is None:
        return None, None
    while hi - lo > resolution(hi):
        mid = (lo + hi) // 2
        hidden, c = at(mid)
        if hidden and c is not None:
            hi, found = mid, (mid, c)
        else:
            lo = mid
    return found, None


def replanned_hiding(best_at: Callable[[int], Candidate], sizes: ModelSizes, hw: HardwareSpec, *,
                     start: int, seq: int, precision: str, max_batch: int = MAX_HIDING_BATCH,
                     mlp_chunk: int = 0) -> IoHiding:
    """When the chosen plan's knobs cannot reach a hiding batch (its host stash outgrows DRAM, or
    its activations the GPU): the planner's best plan at 2, 4, 8... times ``start`` sequences
    (``best_at(batch)``, raising PlanDoesNotFitError), the first that hides the I/O, narrowed down by
    bisection to within an eighth. Costs a few searches: only run when the cheap one failed."""
    fast = dataclasses.replace(hw, ssd_read_gbps=1e12, ssd_write_gbps=1e12)

    why = [""]
    tried: list[tuple[float, int, float]] = []  # (tokens/s, batch, share of the step the SSD adds)

    def at(batch: int) -> tuple[bool, Candidate | None]:
        try:
            c = best_at(batch)
        except PlanDoesNotFitError as exc:
            why[0] = " ".join(str(exc).split(";")[0].split())  # what it needs, not the advice
            return False, None
        ideal = predict_step_time(sizes, c.plan, fast, batch=batch, seq=seq, precision=precision,
                                  mlp_chunk=mlp_chunk)
        tried.append((c.tokens_per_s, batch, c.time.step_s / ideal.step_s - 1))
        return c.time.step_s <= ideal.step_s * (1 + HIDDEN_SHARE), c

    def best_tried() -> str:
        if not tried:
            return ""
        tps, batch, extra = max(tried)
        return (f"; the fastest tried: {batch} sequences per step, {tps:,.0f} tokens/s, the SSD adding "
                f"{extra:.0%} to the step")

    found, stop = _first_hidden(at, start, 2 * start, max_batch, lambda hi: max(1, hi // 8))
    if found is None:
        if stop is not None:
            return IoHiding(None, note=f"no plan fits {stop} sequences per step ({why[0]}){best_tried()}")
        return IoHiding(None, note=f"not hidden up to {max_batch} sequences per step{best_tried()}")
    batch, c = found
    return IoHiding(batch, c.time.step_s, c.tokens_per_s, disk_bytes(sizes, c.plan.offload, precision),
                    c.gpu_need, c.host_need, note=f"re-planned there: {c.describe()}")
