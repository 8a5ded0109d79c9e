"""The engine's long-context QLoRA step on the CPU, each compute task's memory above its start.

Question (issue #32): why did the 2 x 64K QLoRA row peak at 17.87 GiB on the GPU against 9.61
planned? A model at the Llama-3.1-8B shape's ratios, scaled to hidden 1024 (intermediate 3584,
8/2 heads, 4 blocks), NF4 + rank-16 adapters (--train), trains 2 x S tokens on the CPU with the long-context
plan (pack 1, micro-batch 1, MLP chunks of S/8, host stash); a second step is sampled: the
process's resident bytes every ~0.5 ms (run with ``MALLOC_MMAP_THRESHOLD_=65536`` so each large
tensor is its own mapping, returned when freed), each task's span and, for pack 1's backward, the
end of its recompute. Prints each backward's peak above its start in units of one [S, H] tensor.

    MALLOC_MMAP_THRESHOLD_=65536 python bench/archive/engine_task_rss.py --compile inductor --seq 4096
"""

from __future__ import annotations

import argparse
import bisect
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", default="off", help="Config.compile_blocks: off, aot_eager, inductor")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=None, help="MLP chunk tokens (default seq/8; 0: unchunked)")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--segment-attention", type=int, default=1)
    ap.add_argument("--train", choices=("qlora", "lora", "full"), default="qlora",
                    help="NF4 base + adapters, a dense base + adapters, or full fine-tuning")
    a = ap.parse_args()

    import torch
    import transformers

    import tinypipe
    from tinypipe.lora import LoraSettings, apply_lora
    from tinypipe.runtime.handlers import TaskHandlers

    torch.set_num_threads(2)
    seq, chunk = a.seq, a.seq // 8 if a.chunk is None else a.chunk
    hidden = 1024
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=3584, num_attention_heads=8,
                                   num_key_value_heads=2, num_hidden_layers=4, vocab_size=1024,
                                   max_position_embeddings=seq, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    if a.train != "full":
        quantize = "nf4" if a.train == "qlora" else None
        settings = LoraSettings(rank=16, alpha=32.0, quantize=quantize, compute_dtype=a.precision)
        model = apply_lora(model, settings)
    config = tinypipe.Config(devices=["cpu"], precision=a.precision, pack_size=1, micro_batch_size=1,
                             backward_micro_batch_size=1, prefetch_window=1, stash="host",
                             mlp_chunk_tokens=chunk,
                             segment_attention=bool(a.segment_attention), seq_len=seq, global_batch=2,
                             compile_blocks=a.compile, lr=1e-4)
    engine = tinypipe.Engine(model, config)
    batch = {"input_ids": torch.randint(0, 1024, (2, seq), generator=torch.Generator().manual_seed(1))}
    t0 = time.time()
    first = engine.step(batch)
    print(f"step 1: loss {first.loss:.4f}, {time.time() - t0:.0f} s (compiles)", flush=True)

    page = os.sysconf("SC_PAGE_SIZE")
    samples: list[tuple[float, int]] = []
    spans: list[tuple[float, float, str]] = []
    recomputed: dict[str, float] = {}
    stop = threading.Event()

    def sample() -> None:
        with open("/proc/self/statm") as f:
            while not stop.is_set():
                f.seek(0)
                samples.append((time.perf_counter(), int(f.read().split()[1]) * page))
                time.sleep(0.0005)

    run, recompute = TaskHandlers.run, TaskHandlers._recompute

    def timed_run(self, task, dev):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        try:
            return run(self, task, dev)
        finally:
            spans.append((start, time.perf_counter(), str(task.id)))

    def timed_recompute(self, task, dev, x):  # noqa: ANN001, ANN202
        y = recompute(self, task, dev, x)
        recomputed[str(task.id)] = time.perf_counter()
        return y

    TaskHandlers.run, TaskHandlers._recompute = timed_run, timed_recompute
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    second = engine.step(batch)
    stop.set()
    sampler.join()
    unit = seq * hidden * (2 if a.precision == "bf16" else 4)
    times = [t for t, _ in samples]
    print(f"step 2: loss {second.loss:.4f}; {len(samples)} samples; "
          f"u = one [S, H] tensor = {unit / 2**20:.0f} MiB; "
          f"{a.train}, compile {a.compile}, S {seq}, MLP chunk {chunk}, {a.precision}, "
          f"segment attention {a.segment_attention}")
    for start, end, name in sorted(spans, key=lambda s: s[0]):
        if not name.startswith("bwd/"):
            continue
        i0 = max(0, bisect.bisect_left(times, start) - 1)
        i1 = bisect.bisect_right(times, end)
        base = samples[i0][1]
        peak = max(r for _, r in samples[i0:i1]) - base
        line = f"  {name:9s} peak +{peak / unit:5.1f} u above its start"
        if name in recomputed:
            ie = min(len(samples) - 1, bisect.bisect_left(times, recomputed[name]))
            line += f" (after its recompute +{(samples[ie][1] - base) / unit:4.1f} u)"
        print(line)
    engine.close()


if __name__ == "__main__":
    main()
