"""What the planner predicts for one bench/dp_bench.py configuration before it starts (issue #15):
the plan its processes run, their host bytes each, and the pre-flight check of all of them against
the node's available memory -- so a configuration that would not fit is refused with one line
instead of the OOM killer taking the machine.

``--auto``: the planner's plan for the workload (its sequence length and global batch, each of R
replicas training 1/R of it), the per-process GPU cap and the node's host memory shared by the
configuration's processes. Otherwise the hand-set pack size and micro-batch, evaluated the same way.

Why the driver plans rather than each engine: with a forced optimizer sharding the engine's replica
planning (runtime/replica_setup.py ``resolve_replica_plan``) plans every rank as a lone engine --
the node's whole host memory, replicated optimizer state (W3: each of two ranks plans for all 128
GiB; given half, nothing fits: replicated, 12 B/param is 75 GiB). The replica planner
(planner/replica_search.py ``plan_layout``: what the engine runs for ``optimizer_sharding="auto"``
and ``tinypipe plan --gpus-per-replica``) plans one rank's share of the batch against the node's
budget divided by its processes, counting the sharded state as one rank holds it. Every rank then
runs that plan, given to its engine (``Engine(model, cfg, plan=...)``): the ranks agree, and what
the pre-flight check counted is what runs.

It is a prediction: the estimator's host categories and the planner's process baseline (3 GiB),
plus what replicas hold that the planner does not count (:func:`unmodelled`): the sharded
optimizer's gather buffers, gloo's flat all-gather output, and -- ranks sharing a GPU, gloo over
CUDA tensors -- the pinned copies gloo stages each reduced gradient through (the CUDA host caching
allocator rounds each to a power of two and keeps it). Checked on the one replica row measured so
far (W1, 2 ranks sharing the H200, pack 1 / micro-batch 2, ``s6_dp_share_w1_3rows.json``): planner
27.9 GiB + unmodelled 6.2 GiB = 34.1 GiB predicted per process, 33.3 GiB peak RSS measured. The
torchrun launcher is not counted (``--host-reserve-gib`` is kept free for it and the rest).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import transformers

from benchkit.workloads import Workload
from tinypipe.config import Config
from tinypipe.errors import ConfigError, PlanDoesNotFitError
from tinypipe.planner.auto import CPU_HARDWARE, hardware_for, manual_plan
from tinypipe.planner.candidate import Candidate, evaluate
from tinypipe.planner.hardware import HardwareSpec, interconnect_gbs, load_hardware, node_link_for
from tinypipe.planner.replica_search import plan_layout
from tinypipe.planner.replicas import Cluster, Layout, replica_hardware, split_batch
from tinypipe.planner.sharded_host import sharded_candidate
from tinypipe.planner.sizes import ModelSizes, model_sizes
from tinypipe.schedule.plan import Plan

GiB = 1024**3
#: gloo between processes on one machine (bench/archive/gloo_bw.py, results/s6_gloo_bw_cpu.txt: 0.96-1.11
#: GB/s): the link of replicas that share a GPU or run on the CPU; times only, never the plan
GLOO_GBS = 1.0


@dataclass(frozen=True)
class Setting:
    """What dp_bench runs, as the planner needs it."""

    mode: str  # gpu | share | cpu
    sharding: str  # replicate | shard
    auto: bool
    pack_size: int
    micro_batch: int
    precision: str
    cap_bytes: int  # per-process GPU cap, 0: none
    hardware: str | None  # preset name or profile JSON; None: the device's (as the engine picks it)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def unmodelled(sizes: ModelSizes, procs: int, sharding: str, gloo_cuda: bool) -> dict[str, int]:
    """Host bytes per replica process that the planner's estimate leaves out (none alone).

    Sharded (runtime/optim/sharded.py): a gathered layer's R pieces and this rank's padded piece,
    fp32, sized by the largest layer, plus gloo's flat output of each all-gather (the list form
    gathers into one new tensor, then copies: two gloo processes on the CPU, a 2 x 200 MB all-gather
    raised each one's peak RSS by 767 MiB, the output and that copy). ``gloo_cuda`` (ranks sharing
    a GPU): gloo copies each reduced fp32 gradient into a pinned host tensor (ProcessGroupGlooCuda
    ``pinnedLike``); the CUDA host caching allocator rounds it up to a power of two and keeps it for
    reuse -- one block per size class (a sharded layer's reduction is waited before the next one
    is issued; replicated state's all-reduces are not, so there this may count too few)."""
    if procs <= 1:
        return {}
    numels = [n for n in sizes.layer_train_numels if n > 0]
    out: dict[str, int] = {}
    if sharding == "shard":
        piece = -(-max(numels) // procs)
        out["shard_gather_buffers"] = 4 * piece * (procs + 1)
        out["gloo_allgather_output"] = 4 * piece * procs
    if gloo_cuda:
        out["gloo_pinned_staging"] = sum({_pow2_ceil(4 * n) for n in numels})
    return out


@dataclass(frozen=True)
class Prediction:
    """One configuration's plan and the predicted memory. ``host_per_process``: one process's host
    need (the planner's categories and process baseline, plus :func:`unmodelled`); ``need``: all
    the configuration's processes together (on CPU "devices", their memory too)."""

    plan: Plan
    auto: bool
    procs: int
    planner_host: int  # the planner's host need of one process (categories + baseline)
    extra: dict[str, int]  # unmodelled bytes per process
    host: dict[str, int]  # the planner's categories
    device_need: int  # the fullest device entry (on CPU: RAM as well)
    need: int
    budget_node: int  # the node bytes left to the planner's own categories (after the unmodelled)
    step_s: float
    note: str

    @property
    def host_per_process(self) -> int:
        return self.planner_host + sum(self.extra.values())

    @property
    def per_process(self) -> int:
        """What one process should hold at most (its RSS): host, and on the CPU its devices too."""
        return self.need // self.procs

    def as_dict(self) -> dict:
        return {"plan": self.plan.describe(), "plan_json": self.plan.to_json(), "auto": self.auto,
                "procs": self.procs, "per_process": self.per_process,
                "host_per_process": self.host_per_process,
                "planner_host_per_process": self.planner_host, "unmodelled_per_process": self.extra,
                "host": self.host, "device_need": self.device_need, "need_all_processes": self.need,
                "planning_budget_node": self.budget_node, "predicted_step_s": self.step_s, "note": self.note,
                "what": "a prediction (planner estimate + bench/dp_predict.py unmodelled), not a measurement"}

    def text(self) -> str:
        extra = sum(self.extra.values())
        more = f" (planner {self.planner_host / GiB:.1f} + unmodelled {extra / GiB:.1f})" if extra else ""
        dev = self.per_process - self.host_per_process
        more += f" + {dev / GiB:.1f} GiB of its CPU devices" if dev > 0 else ""
        return (f"plan ({'the planner' if self.auto else 'hand-set'}): {self.plan.describe()}\n"
                f"predicted host per process: {self.host_per_process / GiB:.1f} GiB{more}; "
                f"{self.need / GiB:.1f} GiB for its {self.procs} process(es); fullest device "
                f"{self.device_need / GiB:.1f} GiB; {self.step_s:.2f} s/step without the collectives' bound")


def _hardware(s: Setting, devices: list[str]) -> HardwareSpec:
    if s.mode == "cpu":
        return load_hardware(s.hardware) if s.hardware else CPU_HARDWARE
    return hardware_for(Config(devices=devices, hardware=s.hardware))


def _device_budget(s: Setting, entries: int, procs: int, node_bytes: int) -> int | None:
    """GPU bytes per device entry: the cap (entries of one shared GPU split it); on the CPU the
    node's memory shared by every entry of every process; None: the hardware's."""
    if s.mode == "cpu":
        return max(1, node_bytes // (entries * procs))
    if s.cap_bytes <= 0:
        if s.mode == "share" and s.auto:
            raise ConfigError("--auto with --mode share needs --cap-gib: the processes share one GPU")
        return None
    return s.cap_bytes // entries if s.mode == "share" else s.cap_bytes


def predict(w: Workload, s: Setting, procs: int, devices: list[str], node_bytes: int) -> Prediction:
    """The plan ``procs`` processes (replicas when > 1) of ``devices`` each run for ``w``: planned
    (``s.auto``) so that all of them, unmodelled bytes included, fit ``node_bytes``; or hand-set.
    Raises PlanDoesNotFitError / ConfigError (one line) when the planner finds nothing that fits."""
    cfg = transformers.LlamaConfig(**w.config)
    sizes = model_sizes(cfg)
    hw = _hardware(s, devices)
    precision = s.precision if s.mode != "cpu" else "fp32"
    entries = len(devices)
    sharding = s.sharding if procs > 1 else "replicate"
    extra = unmodelled(sizes, procs, sharding, gloo_cuda=s.mode == "share")
    budget = node_bytes - procs * sum(extra.values())  # what the planner's own categories may take
    gpu = _device_budget(s, entries, procs, node_bytes)
    intra = GLOO_GBS if s.mode != "gpu" else interconnect_gbs(node_link_for(hw))
    layout = Layout(procs, entries, procs)
    if s.auto:
        if budget <= 0:
            held = sum(extra.values()) / GiB
            raise PlanDoesNotFitError(f"{layout.describe()}: {node_bytes / GiB:.1f} GiB for the processes, "
                                      f"{procs} x {held:.1f} GiB of it unmodelled buffers: nothing left")
        cluster = Cluster(1, procs * entries, intra, interconnect_gbs("eth25"), budget)
        lp = plan_layout(cfg, hw, cluster, layout, seq=w.seq, global_batch=w.batch, sharding=sharding,
                         gpu_memory_bytes=gpu, precision=precision)
        if lp.refused:
            raise ConfigError(lp.refused)
        if lp.choice is None or lp.choice.result is None:
            held = f" after {sum(extra.values()) / GiB:.1f} GiB unmodelled per process" if extra else ""
            raise PlanDoesNotFitError(f"{layout.describe()}: {' '.join(lp.reason.split())} (the planner had "
                                      f"{budget / procs / GiB:.1f} GiB per process{held})")
        plan, best = lp.plan(), lp.choice.result.best  # best: one rank's host, as the search counted it
        note = lp.reason
    else:
        knobs = Config(devices=devices, pack_size=s.pack_size, micro_batch_size=s.micro_batch)
        plan = manual_plan(knobs, num_blocks=cfg.num_hidden_layers, tied=bool(cfg.tie_word_embeddings))
        plan = dataclasses.replace(plan, replicas=procs, optimizer_sharding=sharding)
        hw_one = replica_hardware(hw, layout, sharding)  # type: ignore[arg-type]
        best = evaluate(sizes, hw_one, plan, seq=w.seq, global_batch=split_batch(w.batch, procs),
                        precision=precision)  # type: ignore[arg-type]
        if sharding == "shard":
            best = sharded_candidate(best, sizes, procs, retain_grads=False)
        note = "hand-set plan, evaluated"
    return _prediction(plan, best, s, procs, entries, extra, budget, note)


def _prediction(plan: Plan, c: Candidate, s: Setting, procs: int, entries: int, extra: dict[str, int],
                budget: int, note: str) -> Prediction:
    device_ram = entries * c.gpu_need if s.mode == "cpu" else 0  # CPU "devices" are host memory too
    need = procs * (c.host_need + sum(extra.values()) + device_ram)
    return Prediction(plan, s.auto, procs, c.host_need, extra, dict(c.memory.host), c.gpu_need, need,
                      budget, c.time.step_s, note)


@dataclass(frozen=True)
class NodeMemory:
    """What new processes can take on this node now, and the readings it came from."""

    available: int
    readings: dict[str, int]
    source: str

    def as_dict(self) -> dict:
        return {"available": self.available, "source": self.source, **self.readings}


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2, no limit): None


def _stat(path: str, key: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except OSError:
        pass
    return 0


def _cgroup_headroom() -> int | None:
    """The memory cgroup's limit minus its usage without the reclaimable inactive page cache
    (None: no limit set). v2 first, then v1 (an unset v1 limit reads as ~2**63)."""
    limit, usage = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    inactive = _stat("/sys/fs/cgroup/memory.stat", "inactive_file")
    if limit is None or usage is None:
        limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
        usage = _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")
        inactive = _stat("/sys/fs/cgroup/memory/memory.stat", "total_inactive_file")
    if limit is None or usage is None or limit >= 1 << 60:
        return None
    return limit - max(0, usage - inactive)


def node_memory(node_limit: int = 0) -> NodeMemory:
    """MemAvailable (/proc/meminfo), bounded by the memory cgroup's headroom when one is set.
    ``node_limit`` > 0: the node's memory where MemTotal under-reports it (a VM whose RAM grows as
    it is used -- the lent H200 machines: MemTotal reads ~31 GiB at the start of a 128+ GiB one):
    that limit minus what is in use now (MemTotal - MemAvailable)."""
    info = _meminfo()
    avail, source = info["MemAvailable"], "MemAvailable"
    if node_limit > 0:
        avail, source = node_limit - (info["MemTotal"] - info["MemAvailable"]), "node limit - in use"
    cg = _cgroup_headroom()
    readings = dict(info, node_limit=node_limit)
    if cg is not None:
        readings["cgroup_headroom"] = cg
        if cg < avail:
            avail, source = cg, "cgroup limit - usage"
    return NodeMemory(avail, readings, source)


@dataclass(frozen=True)
class Preflight:
    """The pre-flight verdict of one configuration: its processes' predicted need vs available."""

    need: int
    available: int
    reserve: int
    ok: bool
    line: str

    def as_dict(self) -> dict:
        return {"need": self.need, "available": self.available, "reserve": self.reserve, "ok": self.ok,
                "line": self.line}


def preflight(p: Prediction, mem: NodeMemory, reserve: int) -> Preflight:
    """Compare ``p``'s need (+ ``reserve`` kept free) with what the node has available now."""
    keep = f" + {reserve / GiB:.1f} GiB kept free" if reserve else ""
    ok = p.need + reserve <= mem.available
    line = (f"pre-flight: predicted host need {p.need / GiB:.1f} GiB ({p.procs} x "
            f"{p.need / p.procs / GiB:.1f}){keep}, available {mem.available / GiB:.1f} GiB ({mem.source}): "
            + ("fits" if ok else "refused, it would not fit" + _hint(mem)))
    return Preflight(p.need, mem.available, reserve, ok, line)


def _hint(mem: NodeMemory) -> str:
    if mem.source != "MemAvailable":
        return ""
    total = mem.readings["MemTotal"] / GiB
    return (f" (MemTotal reads {total:.1f} GiB; on a VM whose RAM grows as it is used, such as the lent "
            "H200 machines, give its memory with --node-memory-gib)")


def refusal(exc: Exception, mem: NodeMemory, reserve: int) -> Preflight:
    """The pre-flight verdict when no plan came out: none fits (PlanDoesNotFitError), or the
    configuration cannot be planned as asked (ConfigError)."""
    why = " ".join(str(exc).split())
    if isinstance(exc, PlanDoesNotFitError):
        why = (f"no plan fits the available {mem.available / GiB:.1f} GiB ({mem.source}, "
               f"{reserve / GiB:.1f} GiB kept free): {why}{_hint(mem)}")
    return Preflight(0, mem.available, reserve, False, f"pre-flight: refused, {why}")
