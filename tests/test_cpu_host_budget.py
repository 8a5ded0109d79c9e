"""On CPU device entries the device pools and activations are host memory (#33): the planner counts
them in the host need, the engine's report lists the pools as a host category, and the process's
measured RSS growth stays within what the planner accounted for (it missed the pools and the
activations before: 1.05 GiB accounted against 1.56 GiB measured for this model)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import tinypipe
from model_zoo import make_batch, make_model
from tinypipe.memory.report import CPU_DEVICE_POOLS
from tinypipe.planner.candidate import HOST_BASELINE_BYTES

GiB = 1024**3

CHILD = textwrap.dedent("""
    import json, sys
    import psutil, torch, transformers
    torch.set_num_threads(1)
    import tinypipe

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    open("/proc/self/clear_refs", "w").write("5")
    base = psutil.Process().memory_info().rss
    cfg = transformers.LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                   num_attention_heads=12, num_key_value_heads=4, vocab_size=8192,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    built = psutil.Process().memory_info().rss
    budget = int(sys.argv[1])
    engine = tinypipe.Engine(model, tinypipe.Config(devices=["cpu"], seq_len=128, global_batch=4,
                                                    precision="fp32", cpu_memory_bytes=budget))
    ids = torch.randint(0, 8192, (4, 128))
    for _ in range(2):
        engine.step({"input_ids": ids})
    best = engine.plan_result.best
    print(json.dumps(dict(base=base, model=built - base, peak=hwm(), host_need=best.host_need,
                          host=engine.memory_report().host)))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")
def test_the_process_stays_within_the_accounted_host_memory() -> None:
    """An 88M-parameter Llama on one CPU entry (every pack kept: activations are the largest CPU
    term), budget 6 GiB: the RSS growth beyond the model object itself is at most the planner's
    accounted bytes (host need less the fixed process baseline) and not far below them; the peak
    is within the budget."""
    budget = 6 * GiB
    proc = subprocess.run([sys.executable, "-c", CHILD, str(budget)], capture_output=True, text=True, timeout=600,
                          env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = rec["peak"] - rec["base"] - rec["model"]
    accounted = rec["host_need"] - HOST_BASELINE_BYTES
    assert CPU_DEVICE_POOLS in rec["host"]
    assert growth <= accounted, (growth / GiB, accounted / GiB)
    assert growth >= 0.6 * accounted, (growth / GiB, accounted / GiB)  # the bound is not vacuous
    assert rec["peak"] <= budget


def test_the_report_and_the_estimate_count_cpu_pools_alike() -> None:
    """The engine's host report holds the CPU entries' pools (their device rows' static bytes), and
    the planner's estimate for the plan holds the same bytes."""
    from tinypipe.planner.estimate import estimate_memory
    from tinypipe.planner.sizes import model_sizes

    model = make_model("llama", layers=4)
    engine = tinypipe.Engine(model, tinypipe.Config(devices=["cpu", "cpu"], pack_size=1, micro_batch_size=2))
    engine.step(make_batch(4, 16))
    rep = engine.memory_report()
    static = sum(rep.device_total(name) for name in rep.devices)
    assert rep.host[CPU_DEVICE_POOLS] == static > 0
    est = estimate_memory(model_sizes(model.config), engine.plan, batch=4, seq=16, precision="fp32",
                          devices=["cpu", "cpu"])
    assert est.host[CPU_DEVICE_POOLS] == static
    engine.close()
