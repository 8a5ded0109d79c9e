"""Memory: byte-exact accounting in ``memory_report()``, the host-RSS budget of a ~56M-parameter
model (one fp32 master + AdamW moments = 12 B/param, plus bounded pools), and no per-step growth.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model

MB = 1e6


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


REPORT_CASES = {
    "fp32_layerwise": dict(devices=["cpu"], pack_size=1),
    "bf16_packs2_window2": dict(devices=["cpu"], pack_size=2, prefetch_window=2, precision="bf16"),
    "n2_host_stash_clip": dict(devices=["cpu"] * 2, pack_size=1, stash="host", max_grad_norm=1.0,
                               host_grad_buffers=2),
    # one pack over three devices: one device holds only the head, none holds everything
    "n3_one_pack_grad_slots": dict(devices=["cpu"] * 3, pack_size=4, prefetch_window=0, grad_slots=4),
    "uneven_skip_policy": dict(devices=["cpu"], pack_size=[3, 1], nonfinite="skip"),
}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("name", list(REPORT_CASES))
def test_memory_report_is_byte_exact(family: str, name: str) -> None:
    cfg = tinypipe.Config(micro_batch_size=2, **REPORT_CASES[name])
    model = make_model(family, layers=4)
    n_params = sum(p.numel() for p in model.parameters())
    eng = tinypipe.Engine(model, cfg)
    dec, plan = eng.decomposition, eng.plan
    flat = sum(layer.numel for layer in dec.layers)
    # alignment only
    assert n_params <= flat <= n_params + 64 * sum(len(layer.params) for layer in dec.layers)
    B, S = 5, 9
    eng.step(make_batch(B, S, seed=1))
    rep = eng.memory_report()

    host = rep.host
    assert host["master_weights"] == 4 * flat
    assert host["optimizer_state"] == 8 * flat
    assert host["master_weights"] == sum(s.master.numel() * s.master.element_size() for s in eng.store.layers)
    slot_numel = max(layer.numel for layer in dec.blocks)
    chunk = min(max(slot_numel, 1 << 16), 1 << 25)
    buffers = max(3, -(-2 * slot_numel // chunk) + 1)
    if cfg.host_grad_buffers is not None:
        buffers = cfg.host_grad_buffers
    retains = cfg.max_grad_norm is not None or cfg.nonfinite == "skip"
    # retained gradients are downloaded straight into their own page-locked buffers: no pool then
    assert host["pinned_grad_pool"] == (0 if retains else len(cfg.devices) * buffers * chunk * 4)
    assert host["gradient_buffers"] == (4 * flat if retains else 0)
    es = _elsize(eng.dtype)
    hidden = int(model.config.hidden_size)
    host_stashes = sum(1 for q, on in enumerate(plan.stash_on_host) if on and q > 0)
    assert host["stashed_activations"] == host_stashes * B * S * hidden * es
    if cfg.stash == "host":
        assert host_stashes == plan.num_packs - 1 > 0
    assert rep.host_total == sum(host.values())

    assert set(rep.devices) == {f"{i}:cpu" for i in range(len(cfg.devices))}
    for i, d in enumerate(eng.devices):
        cats = rep.devices[f"{i}:cpu"]
        has_packs = i in plan.fwd_device or i in plan.bwd_device
        resident = ((dec.embed.numel if i == plan.embed_device else 0)
                    + (dec.head.numel if i == plan.head_device else 0))
        expect = {
            "resident_layers": resident * es,
            "layer_slots": (plan.param_slots() * slot_numel * es) if has_packs else 0,
            "gradient_accumulators": ((plan.grad_slot_count() * slot_numel if has_packs else 0)
                                      + resident) * 4,
            "staging": 0,  # only CUDA devices in bf16 stage fp32 uploads
        }
        assert cats == expect, (i, cats, expect)
        # ... and those are the bytes the pool's buffers really hold
        pool = d.pool
        real = {
            "resident_layers": sum(t.nbytes for t in pool.resident.values()),
            "layer_slots": sum(t.nbytes for t in pool.slots),
            "gradient_accumulators": sum(t.nbytes for t in pool.grad_slots) + sum(
                t.nbytes for t in pool.resident_grads.values()),
            "staging": pool.staging.nbytes if pool.staging is not None else 0,
        }
        assert cats == real
        assert rep.device_total(f"{i}:cpu") == sum(expect.values())
    if name == "n3_one_pack_grad_slots":
        assert rep.devices["2:cpu"]["layer_slots"] == 0  # a device without packs holds no slots

    text = rep.to_text()
    for key in host:
        assert key in text
    for dev_name in rep.devices:
        assert f"device {dev_name}:" in text
    assert "process RSS" in text and rep.host_rss and rep.host_rss_peak >= rep.host_rss
    d = rep.as_dict()
    assert d["host"]["total"] == rep.host_total
    json.dumps(d)  # serialisable as is


# ---------------------------------------------------------------------------------- host RSS

_RSS_WORKER = textwrap.dedent(
    """
    import gc, json, time
    import psutil, torch, transformers
    import tinypipe

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=8000, hidden_size=768, intermediate_size=2048,
                                   num_hidden_layers=7, num_attention_heads=12, num_key_value_heads=12,
                                   max_position_embeddings=256, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).eval()
    n = sum(p.numel() for p in model.parameters())
    batch = {"input_ids": torch.randint(0, 8000, (2, 64), generator=torch.Generator().manual_seed(0))}
    proc = psutil.Process()
    gc.collect()
    before = proc.memory_info().rss
    engine = tinypipe.Engine(model, tinypipe.Config(devices=["cpu"], precision="fp32", max_grad_norm=None,
                                                    lr=1e-4))
    gc.collect()
    built = proc.memory_info().rss
    t0 = time.perf_counter()
    result = engine.step(batch)
    step_s = time.perf_counter() - t0
    gc.collect()
    after = proc.memory_info().rss
    rep = engine.memory_report()
    print(json.dumps(dict(params=n, before=before, built=built, after=after, step_s=step_s, loss=result.loss,
                          host=rep.host, devices=rep.devices, report=rep.to_text())))
    """
)


def test_host_rss_budget_56m_params() -> None:
    """RSS growth from just before Engine() to after the first step <= 13 B/param + 200 MB + stash.

    Runs in a fresh interpreter so memory freed by earlier tests cannot hide growth.
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, "-c", _RSS_WORKER], capture_output=True, text=True, timeout=150,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    n = out["params"]
    assert 50e6 <= n <= 60e6
    growth = out["after"] - out["before"]
    budget = 13 * n + 200 * MB + out["host"]["stashed_activations"]
    print(out["report"])
    print(f"params {n / 1e6:.1f} M; RSS growth: construction {(out['built'] - out['before']) / MB:.0f} MB, "
          f"after first step {growth / MB:.0f} MB = {growth / n:.2f} B/param; budget {budget / MB:.0f} MB; "
          f"step {out['step_s']:.1f} s")
    assert out["host"]["master_weights"] + out["host"]["optimizer_state"] <= 12.01 * n
    assert growth <= budget, f"RSS grew {growth / MB:.0f} MB > budget {budget / MB:.0f} MB"


def test_no_per_step_rss_growth() -> None:
    eng = tinypipe.Engine(make_model("llama", layers=4),
                          tinypipe.Config(devices=["cpu"] * 2, pack_size=1, micro_batch_size=2, stash="host",
                                          max_grad_norm=1.0))
    batches = [make_batch(5, 16, seed=i, pad=i % 2 == 1) for i in range(4)]
    proc = psutil.Process()
    rss = {}
    for i in range(1, 16):
        eng.step(batches[i % len(batches)])
        if i in (5, 15):
            gc.collect()
            rss[i] = proc.memory_info().rss
    print(f"RSS after step 5: {rss[5] / MB:.1f} MB, after step 15: {rss[15] / MB:.1f} MB")
    assert rss[15] - rss[5] <= 20 * MB
    assert len(eng._schedules) == 1  # one batch size, one cached schedule
