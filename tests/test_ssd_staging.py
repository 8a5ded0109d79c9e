"""The planner counts the SSD tier's staging pools as the runtime allocates them: for plans that
differ in every knob the pools depend on (pack sizes, prefetch window, devices, the carried last
pack, resident packs, device-stepped layers, clipping's retained gradients, masters with and
without backward uploads, LoRA's frozen base, the read-ahead), the estimate's ``ssd_staging``
equals a running engine's ``ssd_staging_pool`` byte for byte -- so the planner's closed form
(``tinypipe.planner.offload.staging_shape``) and the runtime's schedule walk
(``tinypipe.schedule.staging.staging_pools``) cannot drift apart."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import tinypipe
from model_zoo import make_batch, make_model
from tinypipe.planner.auto import manual_plan
from tinypipe.planner.estimate import estimate_memory
from tinypipe.planner.offload import offload_order, staging_shape
from tinypipe.planner.sizes import lora_sizes, model_sizes
from tinypipe.storage.store import bounce_bytes

#: name -> (Config fields, which part of the planner's offload order goes to the SSD, LoRA rank)
CASES = {
    "pack1_moments": (dict(pack_size=1), "moments", None),
    "pack2_window2_masters": (dict(pack_size=2, prefetch_window=2), "half", None),
    "uneven_packs_clip_all": (dict(pack_size=[1, 2, 1], max_grad_norm=1.0), "all", None),
    "two_devices_mixed": (dict(devices=["cpu", "cpu"], pack_size=1, prefetch_window=2), "every_other", None),
    "resident_embed_on_device": (dict(pack_size=[1, 2, 1], device_optimizer="embed", resident_packs=1,
                                      max_grad_norm=1.0), "all", None),
    "read_ahead_1": (dict(pack_size=2, extra={"ssd_read_ahead": 1}), "all", None),
    "read_ahead_4_bf16": (dict(pack_size=1, precision="bf16", extra={"ssd_read_ahead": 4}), "half", None),
    "lora_frozen_bf16": (dict(pack_size=2, precision="bf16"), "all", 2),
    "lora_frozen_only": (dict(pack_size=1), "frozen", 2),
}


def _chosen(order: list[tuple[int, str]], which: str) -> tuple[tuple[int, str], ...]:
    if which in ("moments", "frozen"):
        picked = [x for x in order if x[1] == which]
    elif which == "half":
        picked = order[: len(order) // 2]
    elif which == "every_other":
        picked = order[::2]
    else:
        picked = order
    return tuple(sorted(picked))


@pytest.mark.parametrize("case", list(CASES))
def test_planner_staging_equals_the_engines_pools(case: str, tmp_path: Path) -> None:
    kw, which, rank = CASES[case]
    model = make_model("llama", layers=4)
    if rank:
        from tinypipe.lora import LoraSettings, apply_lora

        settings = LoraSettings(rank=rank)
        sizes = lora_sizes(model.config, settings)
        model = apply_lora(model, settings)
    else:
        sizes = model_sizes(model.config)
    cfg = tinypipe.Config(micro_batch_size=2, lr=1e-3, offload_dir=str(tmp_path), **kw)
    base = manual_plan(cfg, num_blocks=4, tied=sizes.tied)
    retain = cfg.max_grad_norm is not None
    offload = _chosen(offload_order(sizes, base, retain_grads=retain), which)
    assert offload, case
    plan = dataclasses.replace(base, offload=offload)
    engine = tinypipe.Engine(model, cfg, plan=plan)
    try:
        engine.step(make_batch(4, 12, seed=1))
        real = engine.memory_report().host["ssd_staging_pool"]
        tier = engine.optimizer.tier
        read_ahead = int(cfg.extra.get("ssd_read_ahead", 2))
        shape = staging_shape(sizes, plan, precision=cfg.precision, read_ahead=read_ahead)
        pools = [(p.slot_bytes, len(p.slots)) if p is not None else (0, 0)
                 for p in (tier.upload_pool, tier.update_pool)]
        assert pools == [(shape.upload_slot_bytes, shape.upload_slots),
                         (shape.update_slot_bytes, shape.update_slots)], case
        assert real == shape.nbytes + bounce_bytes() > 0  # the store's workers' bounce pages
        if read_ahead == 2:  # the estimate the planner fits host memory with
            est = estimate_memory(sizes, plan, batch=4, seq=12, precision=cfg.precision, devices=cfg.devices,
                                  max_grad_norm=cfg.max_grad_norm)
            assert est.host["ssd_staging"] == real
    finally:
        engine.close()
