"""The planner's answers on a fixed set of searches, to show a refactor of the search or the cost
model changes nothing (or to see exactly what a model change moves).

    python bench/plan_fingerprint.py save before.pkl     # on the old code
    python bench/plan_fingerprint.py save after.pkl      # on the new code
    python bench/plan_fingerprint.py compare before.pkl after.pkl

Each search's best plan, its Pareto front (plans, step times, memory by category, needs) and its
counts are compared with ``==``: floats bit for bit. ``save`` also prints each search's CPU seconds
(the best of ``--repeat`` runs; on a shared 2-core VM they vary by tens of percent from run to run,
so compare timings of interleaved runs, not of one each).

    python bench/plan_fingerprint.py schedules before.pkl old.txt   # on the old code
    python bench/plan_fingerprint.py schedules before.pkl new.txt   # on the new code; diff the two

writes the schedules of a saved fingerprint's plans as text (see :func:`schedules`), to show a
change to the schedule's code or types leaves every schedule of those plans as it was.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time

import transformers

from tinypipe.lora.settings import LoraSettings
from tinypipe.planner import plan_for
from tinypipe.planner.ssd import SsdSpec
from tinypipe.units import GIB

W3 = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, num_attention_heads=32,
          num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=4096)
BOX = SsdSpec(1.6, 2.4, source="stated")
NF4 = LoraSettings(rank=16, alpha=32.0, quantize="nf4", compute_dtype="bf16")
H200_24 = dict(gpus=1, gpu_memory_bytes=24 * GIB, seq=2048, global_batch=16)
WIDE = dict(gpus=2, gpu_memory_bytes=80 * GIB, cpu_memory_bytes=4096 * GIB, global_batch=8)

#: name -> (model, hardware, plan_for keywords): full FT and clipping on W1/W3 at 24 GiB, two
#: GPUs, a small model on a roomy and a tight GPU, the SSD tier, QLoRA, LoRA, sharded replicas
SEARCHES = {
    "w3_24": ("llama-2-7b", "h200-pcie5", dict(H200_24, cpu_memory_bytes=128 * GIB)),
    "w3_24_clip": ("llama-2-7b", "h200-pcie5", dict(H200_24, cpu_memory_bytes=128 * GIB,
                                                     max_grad_norm=1.0)),
    "w1_24": ("llama-3.2-3b", "h200-pcie5", dict(H200_24, cpu_memory_bytes=120 * GIB)),
    "w1_24_clip": ("llama-3.2-3b", "h200-pcie5", dict(H200_24, cpu_memory_bytes=120 * GIB,
                                                       max_grad_norm=1.0)),
    "qwen32b_2gpu": ("qwen2.5-32b", "h200-pcie5", dict(WIDE, seq=2048)),
    "gpt2xl_2gpu": ("gpt2-xl", "h200-pcie5", dict(WIDE, seq=1024)),
    "l1b_4090": ("llama-3.2-1b", "rtx4090-pcie4", dict(gpus=1, gpu_memory_bytes=24 * GIB,
                                                        cpu_memory_bytes=64 * GIB, seq=512, global_batch=4)),
    "l1b_4090_tight": ("llama-3.2-1b", "rtx4090-pcie4", dict(gpus=1, gpu_memory_bytes=6 * GIB,
                                                              cpu_memory_bytes=64 * GIB, seq=512,
                                                              global_batch=4)),
    "w3_ssd_48": (W3, "h200-pcie5", dict(H200_24, cpu_memory_bytes=48 * GIB, ssd=BOX, hiding_search=False)),
    "opt13b_4090": ("opt-13b", "rtx4090-pcie4", dict(gpus=1, gpu_memory_bytes=24 * GIB,
                                                      cpu_memory_bytes=256 * GIB, seq=2048, global_batch=8)),
    "l70b_nf4": ("llama-3.1-70b", "rtx4090-pcie4", dict(gpus=1, gpu_memory_bytes=24 * GIB,
                                                         cpu_memory_bytes=64 * GIB, seq=2048, global_batch=8,
                                                         lora=NF4)),
    "l8b_lora_clip_2gpu": ("llama-3.1-8b", "h200-pcie5", dict(gpus=2, gpu_memory_bytes=24 * GIB,
                                                                cpu_memory_bytes=64 * GIB, seq=2048,
                                                                global_batch=16, max_grad_norm=1.0,
                                                                lora=LoraSettings(rank=8))),
    "l8b_shard2_clip": ("llama-3.1-8b", "rtx4090-pcie4", dict(gpus=1, gpu_memory_bytes=24 * GIB,
                                                               cpu_memory_bytes=128 * GIB, seq=2048,
                                                               global_batch=8, host_shards=2,
                                                               max_grad_norm=1.0)),
}


def _candidate(c) -> tuple:  # noqa: ANN001 - a Candidate
    return (c.plan, c.time, c.gpu_need, c.host_need, dict(c.memory.host),
            {k: dict(v) for k, v in c.memory.devices.items()})


def save(path: str, repeat: int) -> None:
    out = {}
    for name, (model, hw, kw) in SEARCHES.items():
        cfg = transformers.LlamaConfig(**model) if isinstance(model, dict) else model
        secs = []
        for _ in range(repeat):
            t0 = time.process_time()
            r = plan_for(cfg, hw, **kw)
            secs.append(time.process_time() - t0)
        out[name] = (_candidate(r.best), [_candidate(c) for c in r.pareto], r.considered, r.fitting)
        print(f"{name:20s} {min(secs):6.2f} s CPU  {r.considered:5d} plans  best {r.best.time.step_s:.6f} s",
              flush=True)
    with open(path, "wb") as f:
        pickle.dump(out, f)


def compare(a_path: str, b_path: str) -> int:
    with open(a_path, "rb") as f:
        a = pickle.load(f)
    with open(b_path, "rb") as f:
        b = pickle.load(f)
    differ = [k for k in a if a[k] != b.get(k)]
    for k in differ:
        print(f"{k}: differs (counts {a[k][2:]} vs {b.get(k, (None,) * 4)[2:]})")
    print("identical" if not differ else f"{len(differ)} of {len(a)} searches differ")
    return 1 if differ else 0


def schedules(path: str, out: str) -> None:
    """Every schedule of the plans in fingerprint ``path`` (each search's best and Pareto front; a
    few batch sizes; with and without replicas' reductions; tied where the plan allows it) as text
    into ``out``: the dump, each task's fields in the global order, each lane's list, the upload
    order, and the SSD staging order for the plan's offload and three made-up ones."""
    from tinypipe.schedule.builder import build_schedule
    from tinypipe.schedule.render import to_text
    from tinypipe.schedule.staging import staging_order
    from tinypipe.schedule.validate import validate

    with open(path, "rb") as f:
        saved = pickle.load(f)
    names = {"master": ["master"], "moments": ["exp_avg", "exp_avg_sq"], "grad": ["grad"],
             "frozen": ["frozen"]}
    count = 0
    with open(out, "w") as f:
        for search, (best, pareto, _, _) in saved.items():
            for i, plan in enumerate(c[0] for c in [best, *pareto]):
                for batch in sorted({1, 3, 2 * plan.micro_batch_size + 1, 16}):
                    tied_ok = plan.head_device == plan.embed_device
                    for reduce, tied in ((False, False), (True, False), (False, tied_ok)):
                        sched = build_schedule(plan, batch, tied=tied, reduce=reduce)
                        validate(sched)
                        f.write(f"=== {search}[{i}] batch={batch} reduce={reduce} tied={tied}\n")
                        f.write(to_text(sched) + "\n")
                        for tid in sched.order:
                            t = sched.tasks[tid]
                            f.write(f"{t.id}|{t.kind.value}|{t.device}|{t.layers}|{t.pack}|{t.mb}|{t.rows}|"
                                    f"{t.slots}|{t.grad_slots}|{t.first}|{t.last}|"
                                    f"{','.join(str(d) for d in t.deps)}|{t.lane}\n")
                        for lane, ids in sched.lanes.items():
                            f.write(f"{lane}: {' '.join(str(x) for x in ids)}\n")
                        f.write(f"upload order {sched.upload_order()}\n")
                        planned: dict[int, list[str]] = {}
                        for layer, kind in plan.offload:
                            planned.setdefault(layer, []).extend(names[kind])
                        every = range(sched.num_layers)
                        for regions in (planned, {x: ["master", "exp_avg", "exp_avg_sq"] for x in every},
                                        {x: ["master", "frozen", "grad"] for x in every if x % 2},
                                        {x: ["exp_avg", "exp_avg_sq", "grad"] for x in every}):
                            if regions:
                                o = staging_order(sched, regions)
                                for s in o.uploads + o.updates:
                                    f.write(f"stage {s.role} {s.layer} {s.names} {s.first}\n")
                                f.write(f"upload_of {[(str(k), v) for k, v in o.upload_of.items()]} "
                                        f"master_of {o.master_of} state_of {o.state_of}\n")
                        count += 1
    print(f"{count} schedules of {sum(1 + len(p) for _, p, _, _ in saved.values())} plans -> {out}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("path")
    s.add_argument("--repeat", type=int, default=1)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    d = sub.add_parser("schedules")
    d.add_argument("path")
    d.add_argument("out")
    args = p.parse_args()
    if args.cmd == "save":
        save(args.path, args.repeat)
        return 0
    if args.cmd == "schedules":
        schedules(args.path, args.out)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
