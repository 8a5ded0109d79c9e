"""Host memory stays flat over 50 steps (fresh interpreter, so earlier tests cannot hide growth)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

MiB = 2**20
BOUND = 3 * MiB  # RSS after step 50 minus after step 10. Measured on 2 cores: 0.7-0.9 MiB with the
# persistent lane workers; 4-9 MiB when every step started its lane threads (glibc malloc arenas)

_WORKER = textwrap.dedent(
    """
    import gc, json, threading, psutil, torch, transformers, tinypipe
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False)
    eng = tinypipe.Engine(transformers.LlamaForCausalLM(cfg),
                          tinypipe.Config(devices=["cpu", "cpu"], pack_size=1, micro_batch_size=2,
                                          stash="host", max_grad_norm=1.0))
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 1000, (4, 32), generator=g)} for _ in range(4)]
    proc, rss = psutil.Process(), {}
    for i in range(1, 51):
        eng.step(batches[i % 4])
        gc.collect()
        rss[i] = proc.memory_info().rss
    print(json.dumps({"rss": rss, "threads": threading.active_count()}))
    """
)


def test_rss_flat_over_50_steps() -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", _WORKER], capture_output=True, text=True, timeout=240,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rss = {int(k): v for k, v in out["rss"].items()}
    growth = rss[50] - rss[10]
    print(f"RSS after step 10: {rss[10] / MiB:.1f} MiB, after step 50: {rss[50] / MiB:.1f} MiB "
          f"(+{growth / MiB:.2f} MiB, {growth / 40 / 1024:.1f} KiB/step); threads {out['threads']}")
    assert growth < BOUND, f"RSS grew {growth / MiB:.1f} MiB from step 10 to 50 (bound {BOUND / MiB:.0f} MiB)"
    # main + one persistent worker per lane (2 devices x 3 lanes + optimizer) + the clipped update's
    # background lane
    assert out["threads"] <= 1 + 8


def test_lane_threads_are_reused_across_steps_and_stop_on_close() -> None:
    import threading

    import tinypipe
    from model_zoo import make_batch, make_model

    eng = tinypipe.Engine(make_model("llama"), tinypipe.Config(devices=["cpu", "cpu"], micro_batch_size=2))
    seen: list[set[int]] = []

    def record(task) -> None:
        seen[-1].add(threading.get_ident())

    eng.fault = record
    for seed in range(3):
        seen.append(set())
        eng.step(make_batch(4, 8, seed=seed))
    assert seen[0] == seen[1] == seen[2] and len(seen[0]) == 7  # 2 devices x 3 lanes + the optimizer lane
    threads = eng.resources.workers.threads()
    assert all(t.is_alive() and not t.name.startswith("tinypipe-") for t in threads)  # idle between steps
    eng.close()
    for t in threads:
        t.join(2.0)
    assert not any(t.is_alive() for t in threads)
