"""The planner's answers on a fixed set of searches, to show a refactor of the search or the cost
model changes nothing (or to see exactly what a model change moves).

    python bench/plan_fingerprint.py save before.pkl     # on the old code
    python bench/plan_fingerprint.py save after.pkl      # on the new code
    python bench/plan_fingerprint.py compare before.pkl after.pkl

Each search's best plan, its Pareto front (plans, step times, memory by category, needs) and its
counts are compared with ``==``: floats bit for bit. ``save`` also prints each search's CPU seconds
(the best of ``--repeat`` runs; on a shared 2-core VM they vary by tens of percent from run to run,
so compare timings of interleaved runs, not of one each).
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("path")
    s.add_argument("--repeat", type=int, default=1)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args()
    if args.cmd == "save":
        save(args.path, args.repeat)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
