"""One host copy regardless of the device count: master weights and AdamW state are allocated once;
host memory grows with N only by the bounded per-device pools (issue #3). Each N runs in a fresh
process so RSS growth is measured from the same starting point."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import gc, json, sys, psutil, torch, transformers
sys.path.insert(0, {tests!r})
import tinypipe
from model_zoo import make_batch
n = int(sys.argv[1])
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                               num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
model = transformers.LlamaForCausalLM(cfg).eval()          # ~31 M parameters: a 375 MB host store
gc.collect()
before = psutil.Process().memory_info().rss
engine = tinypipe.Engine(model, tinypipe.Config(devices=["cpu"] * n, pack_size=2, micro_batch_size=2))
engine.step(make_batch(4, 16))
gc.collect()
grown = psutil.Process().memory_info().rss - before
r = engine.memory_report()
print(json.dumps({{"host": r.host, "grown": grown, "device": sum(r.device_total(k) for k in r.devices)}}))
"""


def run(n: int) -> dict:
    # few malloc arenas: per-thread arenas would otherwise add allocator slack per lane thread
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2")
    script = SCRIPT.format(tests=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", script, str(n)], capture_output=True, text=True, env=env,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_host_store_is_shared_across_devices() -> None:
    rows = {n: run(n) for n in (1, 2, 4)}
    one = rows[1]
    store = one["host"]["master_weights"] + one["host"]["optimizer_state"]
    for n, row in rows.items():
        host = row["host"]
        print(f"N={n}: master {host['master_weights']} optimizer {host['optimizer_state']} "
              f"grad pools {host['pinned_grad_pool']} device pools {row['device']} RSS growth {row['grown']}")
        # one master copy and one optimizer state, whatever N
        assert host["master_weights"] == one["host"]["master_weights"]
        assert host["optimizer_state"] == one["host"]["optimizer_state"]
        # only the per-device pools scale with N
        assert host["pinned_grad_pool"] == n * one["host"]["pinned_grad_pool"]
        # RSS grows by the store once plus the pools (CPU "device" pools are host memory here)
        pools = host["pinned_grad_pool"] + row["device"]
        assert row["grown"] <= store + pools + 192 * 2**20, (n, row)  # + activations, allocator slack
    # going from 1 to 4 devices adds the extra pools, never another copy of the store
    def pools_of(row: dict) -> int:
        return row["host"]["pinned_grad_pool"] + row["device"]

    extra = pools_of(rows[4]) - pools_of(one)
    assert rows[4]["grown"] - one["grown"] <= extra + store // 4
