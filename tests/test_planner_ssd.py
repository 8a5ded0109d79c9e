"""The planner's side of the SSD tier (issue #13): what goes to the SSD and what it costs.

The host need with offload is checked against what the runtime allocates: the host store's tensors
per layer and kind (the engine with the SSD tier lands on another branch; the lead adds the
engine cross-check after the merge), a real StagingPool of the stated shape, and a real
SsdStateStore's file size. Formula (tinypipe.planner.offload): every DRAM category loses its
offloaded regions (master 4t, moments 2 x 4t, grad 4t, frozen a*f per layer) and ``ssd_staging``
is the runtime's two staging pools (tinypipe.schedule.staging.staging_pools), in closed form.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import transformers

import tinypipe
from model_zoo import make_batch, make_model
from tinypipe.cli import main as cli_main
from tinypipe.errors import ConfigError, PlanDoesNotFitError
from tinypipe.memory.report import GIB
from tinypipe.planner import load_hardware, model_sizes, plan_for, predict_step_time
from tinypipe.planner.auto import resolve_plan
from tinypipe.planner.candidate import HOST_BASELINE_BYTES
from tinypipe.memory.report import CPU_DEVICE_POOLS
from tinypipe.planner.estimate import cpu_pool_bytes, estimate_memory, host_bytes
from tinypipe.planner.hardware import TYPICAL_NVME_GEN4
from tinypipe.planner.offload import (
    REGIONS,
    choose_offload,
    disk_bytes,
    layer_order,
    offload_order,
    ssd_traffic,
    staging_shape,
)
from tinypipe.planner.spill import HIDDEN_SHARE
from tinypipe.planner.ssd import SsdSpec, ssd_spec
from tinypipe.schedule.plan import Plan, make_plan
from tinypipe.schedule.staging import staging_pools
from tinypipe.storage import SsdStateStore, StagingPool
from tinypipe.storage.store import bounce_bytes

W3 = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, num_attention_heads=32,
          num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=4096)
GPU_BOX = SsdSpec(1.6, 2.4, source="stated")  # the GPU machine's disk (O_DIRECT, measured there)


def _plan(sizes, **kw) -> Plan:
    args = dict(pack_size=1, micro_batch_size=2, backward_micro_batch_size=2, num_devices=1, prefetch_window=1,
                stash="host", tied=sizes.tied)
    args.update(kw)
    return make_plan(sizes.num_blocks, **args)


# ------------------------------------------------------------------ host need vs the host store

ENGINE_CASES = {
    "fp32_pack1": (dict(devices=["cpu"], pack_size=1, precision="fp32", stash="host"), None),
    "bf16_pack2_w2_clip": (dict(devices=["cpu"], pack_size=2, precision="bf16", stash="host",
                                prefetch_window=2, max_grad_norm=1.0), None),
    "embed_on_device_clip": (dict(devices=["cpu"], pack_size=[1, 2, 1], device_optimizer="embed",
                                  resident_packs=1, max_grad_norm=1.0), None),
    "lora_bf16_n2": (dict(devices=["cpu", "cpu"], pack_size=2, precision="bf16", stash="host"), 4),
}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_host_need_with_offload_equals_the_store_per_kind(family: str, case: str, tmp_path) -> None:
    kw, lora_rank = ENGINE_CASES[case]
    model = make_model(family, layers=4)
    if lora_rank:
        from tinypipe.lora.settings import LoraSettings, apply_lora
        from tinypipe.planner.sizes import lora_sizes

        settings = LoraSettings(rank=lora_rank)
        sizes = lora_sizes(model.config, settings)
        model = apply_lora(model, settings)
    else:
        sizes = model_sizes(model.config)
    cfg = tinypipe.Config(micro_batch_size=2, **kw)
    engine = tinypipe.Engine(model, cfg)
    B, S = 5, 9
    engine.step(make_batch(B, S, seed=1))
    real = engine.memory_report().host
    real.pop(CPU_DEVICE_POOLS)  # the CPU entries' pools: estimate_memory's, not host_bytes' (the store's)
    layers = engine.store.layers
    retain = cfg.max_grad_norm is not None
    order = offload_order(sizes, engine.plan, retain_grads=retain)
    kinds = {k for _, k in order}
    # under LoRA the adapters' masters stay in DRAM (the runtime refuses to offload them)
    assert kinds == ({"moments"} | ({"master"} if not lora_rank else set()) | ({"grad"} if retain else set())
                     | ({"frozen"} if lora_rank else set()))
    on_device = {x for d in range(engine.plan.num_devices) for x in engine.plan.device_optimized(d)}
    assert not any(x in on_device for x, _ in order)  # layers stepped on a device never leave DRAM
    if retain:  # the runtime retains 4 B per master element of every host-stepped layer
        assert real["gradient_buffers"] == sum(4 * layers[x].master.numel() for x in range(len(layers))
                                               if x not in on_device)
    # a mixed set: the first half of the order, and every other item of the rest
    chosen = tuple(sorted(order[: len(order) // 2] + order[len(order) // 2 :: 2]))
    plan = dataclasses.replace(engine.plan, offload=chosen)
    est = host_bytes(sizes, plan, batch=B, seq=S, precision=cfg.precision, num_devices=len(cfg.devices),
                     host_grad_buffers=cfg.host_grad_buffers, retain_grads=retain)
    expect = dict(real)
    regions: dict[tuple, int] = {}
    for x, kind in chosen:
        st = layers[x]
        if kind == "master":
            regions[(x, "master")] = st.master.numel() * 4
        elif kind == "moments":
            regions[(x, "exp_avg")] = st.exp_avg.numel() * 4
            regions[(x, "exp_avg_sq")] = st.exp_avg_sq.numel() * 4
        elif kind == "grad":
            regions[(x, "grad")] = st.master.numel() * 4
        else:
            regions[(x, "frozen")] = st.frozen.numel() * st.frozen.element_size()
    cat = {"master": "master_weights", "exp_avg": "optimizer_state", "exp_avg_sq": "optimizer_state",
           "grad": "gradient_buffers", "frozen": "frozen_weights"}
    for (x, name), nbytes in regions.items():
        expect[cat[name]] -= nbytes
    if expect.get("frozen_weights") == 0:
        del expect["frozen_weights"]
    # the runtime's pools for these regions (tinypipe.schedule.staging walks the schedule), allocated
    shape = staging_pools(plan, sizes.tied, regions)
    pools = [StagingPool(n, b) for n, b in ((shape.upload_slots, shape.upload_slot_bytes),
                                             (shape.update_slots, shape.update_slot_bytes)) if n]
    expect["ssd_staging"] = sum(p.nbytes for p in pools) + bounce_bytes()  # + the store's bounce pages
    assert est == expect
    assert staging_shape(sizes, plan, precision=cfg.precision) == shape
    with SsdStateStore(tmp_path, regions, preallocate=False) as store:  # the scratch file's layout
        assert store.nbytes == disk_bytes(sizes, chosen, cfg.precision)
    engine.close()


def test_without_offload_nothing_changes() -> None:
    sizes = model_sizes(transformers.LlamaConfig(**W3))
    plan = _plan(sizes)
    assert plan.offload == () and ssd_traffic(sizes, plan, "bf16").read_bytes == 0
    t = predict_step_time(sizes, plan, load_hardware("h200-pcie5"), batch=16, seq=2048)
    assert "ssd_read_bytes" not in t.as_dict() and set(t.lanes()) == {"compute", "upload", "download",
                                                                      "cpu optimizer"}
    rep = estimate_memory(sizes, plan, batch=16, seq=2048, precision="bf16", devices=["cuda:0"])
    assert "ssd_staging" not in rep.host


# --------------------------------------------------------------------------- choices and order


def test_layer_order_easiest_to_hide_first() -> None:
    sizes = model_sizes(transformers.LlamaConfig(**dict(W3, num_hidden_layers=6)))
    plan = _plan(sizes, pack_size=2)  # packs (0,1) (2,3) (4,5): layers 1-2 are the tail pack
    assert layer_order(plan) == [6, 5, 4, 3, 2, 1, 7, 0]
    res = dataclasses.replace(plan, resident_packs=1, device_optimizer="embed")
    assert layer_order(res) == [6, 5, 4, 3, 7]  # resident pack and the GPU-stepped embedding never move
    order = offload_order(sizes, plan, retain_grads=True)
    kinds = [k for _, k in order]
    assert kinds == ["moments"] * 8 + ["grad"] * 8 + ["master"] * 8
    assert [k for _, k in offload_order(sizes, plan, retain_grads=False)] == ["moments"] * 8 + ["master"] * 8


def test_lora_frozen_weights_go_last() -> None:
    from tinypipe.lora.settings import LoraSettings
    from tinypipe.planner.sizes import lora_sizes

    sizes = lora_sizes(transformers.LlamaConfig(**dict(W3, num_hidden_layers=4)), LoraSettings(rank=8))
    plan = _plan(sizes)
    order = offload_order(sizes, plan, retain_grads=False)
    kinds = [k for _, k in order]
    # the adapters' masters stay in DRAM (the runtime refuses them); embedding and head: frozen only
    assert kinds == ["moments"] * 4 + ["frozen"] * 6
    assert order[-2:] == [(5, "frozen"), (0, "frozen")]


@pytest.mark.parametrize("clip", [None, 1.0])
def test_choices_fit_and_grow_as_the_budget_shrinks(clip: float | None) -> None:
    sizes = model_sizes(transformers.LlamaConfig(**W3))
    plan = _plan(sizes)
    retain = clip is not None
    host = host_bytes(sizes, plan, batch=16, seq=2048, precision="bf16", num_devices=1, retain_grads=retain)
    dram = sum(host.values())
    previous: set = set()
    kinds_seen = []
    for budget_gib in range(int(dram / GIB) + 1, 0, -2):
        budget = budget_gib * GIB
        chosen = choose_offload(sizes, plan, host, budget, precision="bf16", retain_grads=retain)
        if chosen is None:
            assert budget < dram / 4  # only when nothing but the pools and the stash would be left
            break
        need = sum(host_bytes(sizes, dataclasses.replace(plan, offload=chosen), batch=16, seq=2048,
                              precision="bf16", num_devices=1, retain_grads=retain).values())
        assert need <= budget
        assert previous <= set(chosen)  # monotone: a smaller budget keeps what was on the SSD
        previous = set(chosen)
        kinds_seen.append({k for _, k in chosen})
    assert kinds_seen[0] == set()  # the whole state fit
    # moments first, then retained gradients, then masters
    firsts = [next((i for i, s in enumerate(kinds_seen) if k in s), None) for k in ("moments", "grad", "master")]
    assert firsts[0] is not None and firsts[2] is not None and firsts[0] <= firsts[2]
    if retain:
        assert firsts[0] <= firsts[1] <= firsts[2]


def test_plan_for_fits_the_host_with_the_ssd() -> None:
    """W3 (7B) full FT on 24 GiB + 48 GiB of DRAM: refused without the SSD, with it the state
    moves there, the host need fits, and less DRAM means more on the SSD."""
    kw = dict(gpus=1, gpu_memory_bytes=24 * GIB, seq=2048, global_batch=16)
    cfg = transformers.LlamaConfig(**W3)
    with pytest.raises(PlanDoesNotFitError, match="host memory"):
        plan_for(cfg, "h200-pcie5", cpu_memory_bytes=48 * GIB, **kw)
    on_ssd = []
    for gib in (64, 48, 32):
        r = plan_for(cfg, "h200-pcie5", cpu_memory_bytes=gib * GIB, ssd=GPU_BOX, hiding_search=False, **kw)
        assert r.best.plan.offload and r.best.host_need <= gib * GIB
        assert r.best.memory.host["ssd_staging"] > 0
        on_ssd.append(disk_bytes(r.sizes, r.best.plan.offload, "bf16"))
        assert r.best.time.ssd_read_bytes >= on_ssd[-1] and r.best.time.ssd_write_bytes > 0
        assert all(c.host_need <= gib * GIB for c in r.pareto)
    assert on_ssd == sorted(on_ssd)
    roomy = plan_for(cfg, "h200-pcie5", cpu_memory_bytes=512 * GIB, ssd=GPU_BOX, **kw)
    plain = plan_for(cfg, "h200-pcie5", cpu_memory_bytes=512 * GIB, **kw)
    assert roomy.best.plan == plain.best.plan and roomy.hiding is None  # fits DRAM: the SSD stays unused


# ------------------------------------------------------------------------------ bandwidth model


def test_ssd_traffic_and_lanes() -> None:
    sizes = model_sizes(transformers.LlamaConfig(**dict(W3, num_hidden_layers=6)))
    plan = _plan(sizes, pack_size=2)
    t = [sizes.layer_train_numels[x] for x in range(8)]
    offload = ((0, "master"), (2, "grad"), (3, "moments"), (4, "master"), (5, "moments"), (7, "moments"))
    p = dataclasses.replace(plan, offload=offload)
    tr = ssd_traffic(sizes, p, "bf16")
    # moments: read and written once (8 B/element each way); master: read twice, written once; grad: written
    assert tr.read_bytes == 8 * (t[3] + t[5] + t[7]) + 2 * 4 * (t[0] + t[4])
    assert tr.write_bytes == 8 * (t[3] + t[5] + t[7]) + 4 * (t[0] + t[4]) + 4 * t[2]
    assert tr.fill_read == 4 * t[0]  # the embedding's master precedes the first compute
    assert tr.forward_read == 4 * t[4]  # a later pack's master: ahead of its forward upload
    # layers stepped after the backward (pack 0, the embedding): masters before the next fill,
    # moments and gradients beside the next step's forward
    assert tr.tail_write == 4 * t[0] and tr.carry_write == 4 * t[2]
    hw = load_hardware("h200-pcie5")
    slow = predict_step_time(sizes, p, hw, batch=16, seq=2048)
    assert slow.ssd_read_s == pytest.approx(tr.read_bytes / 1.6e9)
    assert slow.ssd_write_s == pytest.approx(tr.write_bytes / 2.4e9)
    fast_hw = dataclasses.replace(hw, ssd_read_gbps=3.2, ssd_write_gbps=4.8)
    fast = predict_step_time(sizes, p, fast_hw, batch=16, seq=2048)
    assert fast.ssd_read_s == pytest.approx(slow.ssd_read_s / 2)
    assert fast.step_s <= slow.step_s
    free = predict_step_time(sizes, p, dataclasses.replace(hw, ssd_read_gbps=1e9, ssd_write_gbps=1e9),
                             batch=16, seq=2048)
    dram = predict_step_time(sizes, plan, hw, batch=16, seq=2048)
    assert free.step_s == pytest.approx(dram.step_s, rel=1e-6)  # an infinitely fast SSD costs nothing
    crawl = predict_step_time(sizes, p, dataclasses.replace(hw, ssd_read_gbps=0.01, ssd_write_gbps=0.01),
                              batch=16, seq=2048)
    assert crawl.limit == "ssd" and crawl.step_s >= (crawl.ssd_read_s + crawl.ssd_write_s) * 0.99
    with pytest.raises(ConfigError, match="ssd_read_gbps"):
        predict_step_time(sizes, p, dataclasses.replace(hw, ssd_read_gbps=None), batch=16, seq=2048)


def test_a_measured_mixed_rate_lets_reads_and_writes_overlap() -> None:
    """Unknown overlap: the SSD lane of a phase that reads and writes is the serial time. A mixed
    rate measured with the two solo rates bounds it instead: no faster than either direction
    alone nor than both at the mixed rate, and never slower than serial (a mixed rate below the
    serial one changes nothing)."""
    from tinypipe.planner.ssd_lanes import SsdLanes

    sizes = model_sizes(transformers.LlamaConfig(**dict(W3, num_hidden_layers=6)))
    p = dataclasses.replace(_plan(sizes, pack_size=2), offload=tuple((x, "moments") for x in range(8)))
    hw = dataclasses.replace(load_hardware("h200-pcie5"), ssd_read_gbps=1.6, ssd_write_gbps=2.4)
    lanes = SsdLanes(ssd_traffic(sizes, p, "bf16"), hw)
    r, w = 4e9, 4e9
    assert lanes.both(r, w) == pytest.approx(r / 1.6e9 + w / 2.4e9)  # serial: 4.17 s
    duplex = SsdLanes(lanes.t, dataclasses.replace(hw, ssd_mixed_gbps=2.5))
    assert duplex.both(r, w) == pytest.approx((r + w) / 2.5e9)  # 3.2 s: the mixed rate bounds it
    assert duplex.both(r, 0.0) == pytest.approx(r / 1.6e9)  # reads alone: the read rate
    full = SsdLanes(lanes.t, dataclasses.replace(hw, ssd_mixed_gbps=100.0))
    assert full.both(r, w) == pytest.approx(max(r / 1.6e9, w / 2.4e9))  # 2.5 s: each direction's own floor
    shared = SsdLanes(lanes.t, dataclasses.replace(hw, ssd_mixed_gbps=1.0))
    assert shared.both(r, w) == pytest.approx(lanes.both(r, w))  # worse than serial: serial
    # the step: an I/O-bound plan gets faster with a mixed rate, by the lanes' difference
    slow_hw = dataclasses.replace(hw, ssd_read_gbps=0.05, ssd_write_gbps=0.05)
    serial = predict_step_time(sizes, p, slow_hw, batch=16, seq=2048)
    overlap = predict_step_time(sizes, p, dataclasses.replace(slow_hw, ssd_mixed_gbps=0.1), batch=16, seq=2048)
    same = predict_step_time(sizes, p, dataclasses.replace(slow_hw, ssd_mixed_gbps=0.025), batch=16, seq=2048)
    assert serial.limit == "ssd" and overlap.step_s < 0.8 * serial.step_s
    assert same.step_s == pytest.approx(serial.step_s)
    tr = ssd_traffic(sizes, p, "bf16")  # every byte is read once and written once per step
    assert overlap.step_s >= (tr.read_bytes + tr.write_bytes) / 0.1e9 * 0.99


def test_the_mixed_rate_travels_with_its_measurement(tmp_path) -> None:
    """A hardware file's mixed rate reaches the plan with its two rates; a stated rate drops it
    (it was not measured with the stated one); ``--offload-dir`` measures it."""
    f = tmp_path / "box.json"
    f.write_text(json.dumps(dict(gpu_memory="24GiB", h2d_gbs=25, d2h_gbs=25, bidir_gbs=45, bf16_tflops=90,
                                 cpu_adamw_gparams_s=2, ssd_read_gbps=1.6, ssd_write_gbps=2.5,
                                 ssd_mixed_gbps=2.6)))
    box = load_hardware(str(f))
    s = ssd_spec(box)
    assert s.mixed_gbps == 2.6 and s.apply(load_hardware("rtx4090-pcie4")).ssd_mixed_gbps == 2.6
    assert ssd_spec(box, write_gbps=3.0).mixed_gbps is None
    assert ssd_spec(load_hardware("rtx4090-pcie4")).mixed_gbps is None  # a preset: serial
    measured = ssd_spec(load_hardware("rtx4090-pcie4"), directory=tmp_path, measure=True)
    assert measured.mixed_gbps is not None and measured.mixed_gbps > 0


def test_the_hiding_batch_hides_the_io() -> None:
    """W3 (7B) on 24 GiB + 48 GiB at 1.6 / 2.4 GB/s: at 16 sequences the SSD bounds the step and
    these knobs cannot grow the batch on 24 GiB (a device stash), so the planner re-plans; the
    batch it reports runs with the SSD hidden. At 128 sequences the chosen knobs get there
    themselves: hidden at the reported batch, not one sequence below it. (The H200 at the 400
    TFLOP/s of eager blocks: with the compiled blocks' 525 the same knobs need a re-plan at 128.)"""
    hw = dataclasses.replace(load_hardware("h200-pcie5"), bf16_tflops=400.0)
    # two of the GPU box's disks (one disk serves reads and writes in turn: with one, W3's I/O
    # stays exposed up to 256 sequences on 24 GiB -- the search reports the fastest it tried)
    box = SsdSpec(2 * GPU_BOX.read_gbps, 2 * GPU_BOX.write_gbps, source=GPU_BOX.source)
    from tinypipe.planner.search import evaluate
    from tinypipe.planner.spill import Spill

    kw = dict(gpus=1, gpu_memory_bytes=24 * GIB, cpu_memory_bytes=48 * GIB, seq=2048, ssd=box)
    cfg = transformers.LlamaConfig(**W3)
    small = plan_for(cfg, hw, global_batch=16, **kw)
    assert small.best.time.limit == "ssd"
    h = small.hiding
    assert h is not None and h.batch is not None and 16 < h.batch <= 256 and h.note.startswith("re-planned")
    assert h.tokens_per_s > 3 * small.best.tokens_per_s
    fast = dataclasses.replace(small.hardware, ssd_read_gbps=1e12, ssd_write_gbps=1e12)
    there = plan_for(cfg, hw, global_batch=h.batch, hiding_search=False, **kw).best
    ideal = predict_step_time(small.sizes, there.plan, fast, batch=h.batch, seq=2048)
    assert there.time.step_s <= ideal.step_s * (1 + HIDDEN_SHARE)

    big = plan_for(cfg, hw, global_batch=128, **kw)
    h = big.hiding
    assert h is not None and h.batch is not None and h.fits_gpu and not h.note

    def at(batch: int):
        spill = Spill(big.sizes, box, 48 * GIB, precision="bf16", retain_grads=False)
        plan = dataclasses.replace(big.best.plan, offload=())

        def ev(p: Plan, _peaks=None):
            return evaluate(big.sizes, big.hardware, p, seq=2048, global_batch=batch)

        c = spill.settle(ev(plan), ev)
        ideal = predict_step_time(big.sizes, c.plan, fast, batch=batch, seq=2048)
        return c.time.step_s <= ideal.step_s * (1 + HIDDEN_SHARE)

    assert at(h.batch) and not at(h.batch - 1)


# ------------------------------------------------------------------------------- errors, rates


def test_nothing_fits_even_with_the_ssd() -> None:
    kw = dict(gpus=1, gpu_memory_bytes=24 * GIB, seq=2048, global_batch=16)
    with pytest.raises(PlanDoesNotFitError, match=r"needs \d+\.\d GiB host memory even with its training "
                                                  r"state on the SSD, have 8\.0 GiB"):
        plan_for("llama-2-13b", "rtx4090-pcie4", cpu_memory_bytes=8 * GIB, ssd=GPU_BOX, **kw)
    small_disk = SsdSpec(1.6, 2.4, directory="/scratch", free_bytes=10 * GIB)
    with pytest.raises(PlanDoesNotFitError, match=r"SSD scratch space on /scratch .* 10\.0 GiB free"):
        plan_for("llama-2-13b", "rtx4090-pcie4", cpu_memory_bytes=96 * GIB, ssd=small_disk, **kw)
    with pytest.raises(PlanDoesNotFitError, match="GPU memory per device"):  # the GPU, not the host
        plan_for("llama-3.1-70b", "rtx4090-pcie4", cpu_memory_bytes=128 * GIB, ssd=GPU_BOX, **kw)


def test_rates_come_from_flags_files_measurements_or_presets(tmp_path) -> None:
    preset = load_hardware("rtx4090-pcie4")
    assert (preset.ssd_read_gbps, preset.ssd_write_gbps) == TYPICAL_NVME_GEN4
    assert load_hardware("h200-pcie5").ssd_read_gbps == 1.6
    s = ssd_spec(preset)
    assert (s.read_gbps, s.write_gbps) == TYPICAL_NVME_GEN4 and "typical NVMe Gen4" in s.source
    s = ssd_spec(preset, directory=tmp_path, measure=True)  # a real measurement (1 GiB)
    assert s.read_gbps > 0 and s.write_gbps > 0 and s.source.startswith("measured on")
    assert s.free_bytes and s.free_bytes > 0
    f = tmp_path / "box.json"
    f.write_text(json.dumps(dict(gpu_memory="24GiB", h2d_gbs=25, d2h_gbs=25, bidir_gbs=45, bf16_tflops=90,
                                 cpu_adamw_gparams_s=2, ssd_read_gbps=9.5, ssd_write_gbps=4.5)))
    box = load_hardware(str(f))
    s = ssd_spec(box, directory=tmp_path, measure=True)  # recorded rates: no measurement
    assert (s.read_gbps, s.write_gbps) == (9.5, 4.5) and s.source == "hardware file box"
    s = ssd_spec(box, read_gbps="2.5")
    assert (s.read_gbps, s.write_gbps) == (2.5, 4.5) and s.source.startswith("stated")
    assert ssd_spec(box, directory=tmp_path / "absent").free_bytes is None
    for bad in ("0", "-1", "fast"):
        with pytest.raises(ConfigError, match="--ssd-read-gbps"):
            ssd_spec(box, read_gbps=bad)
    f.write_text(json.dumps(dict(gpu_memory="24GiB", h2d_gbs=25, d2h_gbs=25, bidir_gbs=45, bf16_tflops=90,
                                 cpu_adamw_gparams_s=2, ssd_write_gbps=0)))
    with pytest.raises(ConfigError, match="ssd_write_gbps must be > 0"):
        load_hardware(str(f))


# ---------------------------------------------------------------------------------- the CLI

PLAN_13B = ["plan", "--model", "llama-2-13b", "--gpus", "1", "--gpu-memory", "24GiB", "--cpu-memory", "128GiB",
            "--seq-len", "2048", "--global-batch", "16"]


def test_cli_says_what_goes_where(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(PLAN_13B) == 1  # 13B full FT needs ~150 GiB of DRAM
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "host memory" in err[0]
    assert cli_main(PLAN_13B + ["--ssd-read-gbps", "1.6", "--ssd-write-gbps", "2.4"]) == 0
    out = capsys.readouterr().out
    assert ("SSD tier (read 1.60 GB/s, write 2.40 GB/s, reads and writes planned one after the other: "
            "stated)") in out
    assert "offload: moments of" in out and "ssd_staging" in out
    assert " moments " in out and " master " in out and "per step: read" in out
    assert "the step is bound by" in out and "I/O hidden (adds < 5% to the step) from a global batch of" in out
    assert cli_main(PLAN_13B + ["--ssd-read-gbps", "1.6", "--ssd-write-gbps", "2.4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    off = d["offload"]
    assert d["best"]["plan"]["offload"] and off["bound"] in ("compute", "ssd", "cpu optimizer",
                                                             "upload", "download")
    kinds = {k["kind"]: k for k in off["kinds"]}
    assert kinds["moments"]["on_ssd"] > 0 and kinds["moments"]["ssd_bytes"] > 0
    assert off["read_bytes_per_step"] > 0 and off["hiding"]["batch"] >= 1
    assert Plan.from_json(json.dumps(d["best"]["plan"])).offload == tuple(map(tuple, d["best"]["plan"]["offload"]))
    # without the SSD flags: no SSD anywhere in the output
    assert cli_main(PLAN_13B[:-6] + ["--cpu-memory", "512GiB", "--seq-len", "2048", "--global-batch", "16",
                                     "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "offload" not in d and d["best"]["plan"]["offload"] == [] and "ssd_read_s" not in d["best"]["time"]


def test_cli_profile_rates_and_errors(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "profile.json"
    assert cli_main(["profile", "--device", "cpu", "--model", "none", "--offload-dir", str(tmp_path),
                     "--ssd-bytes", "130MiB", "--output", str(prof)]) == 0
    d = json.loads(prof.read_text())
    assert d["ssd_read_gbps"] > 0 and d["ssd_write_gbps"] > 0 and d["ssd"]["directory"] == str(tmp_path)
    assert d["ssd"]["nbytes"] == 3 * (64 << 20)  # whole 64 MiB requests
    capsys.readouterr()
    for size in ("64MiB", "lots"):
        assert cli_main(["profile", "--device", "cpu", "--model", "none", "--offload-dir", str(tmp_path),
                         "--ssd-bytes", size, "--output", str(prof)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--ssd-bytes must be" in err[0], err
    hw = load_hardware(str(prof))
    assert hw.ssd_read_gbps == d["ssd_read_gbps"]
    assert d["ssd_mixed_gbps"] > 0 and hw.ssd_mixed_gbps == d["ssd_mixed_gbps"]  # both at once, measured
    capsys.readouterr()
    args = PLAN_13B + ["--hardware", str(prof), "--gpu-memory", "24GiB", "--offload-dir", str(tmp_path)]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert f"SSD tier ({tmp_path}; read {d['ssd_read_gbps']:.2f} GB/s" in out and "hardware file" in out
    assert f"both at once {d['ssd_mixed_gbps']:.2f} GB/s" in out
    assert "scratch file" in out and "free" in out
    assert cli_main(args + ["--ssd-write-gbps", "5"]) == 0
    # a stated rate was not measured with the file's mixed rate: reads and writes planned serially
    assert "write 5.00 GB/s, reads and writes planned one after the other: stated, hardware file" in (
        capsys.readouterr().out)
    for bad in (["--ssd-read-gbps", "0"], ["--ssd-write-gbps", "many"]):
        assert cli_main(PLAN_13B + bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("tinypipe plan: error:"), err
    assert cli_main(PLAN_13B[:8] + ["8GiB", "--seq-len", "2048", "--global-batch", "16", "--ssd-read-gbps", "1.6",
                                    "--ssd-write-gbps", "2.4"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "even with its training state on the SSD" in err[0]
    assert cli_main(["profile", "--device", "cpu", "--model", "none", "--offload-dir", str(tmp_path / "no"),
                     "--output", str(prof)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]


# ------------------------------------------------------------------------------ the engine's plan


def _leanest_host_need(model, config: tinypipe.Config, sizes, high: int, step: int) -> int:  # noqa: ANN001
    """The least host budget (to ``step`` bytes) some plan fits without the SSD (on CPU entries the
    plans' pools and activations are host memory, so they differ in it): a bisection."""
    low = HOST_BASELINE_BYTES
    while high - low > step:
        mid = (low + high) // 2
        try:
            resolve_plan(model, dataclasses.replace(config, cpu_memory_bytes=mid), num_blocks=4, tied=sizes.tied)
            high = mid
        except PlanDoesNotFitError:
            low = mid
    return high


def test_engine_plans_the_offload_from_config(tmp_path) -> None:
    model = make_model("llama", layers=4)
    sizes = model_sizes(model.config)
    work = dict(devices=["cpu"], seq_len=16, global_batch=4)
    roomy = tinypipe.Config(**work)
    plan, result = resolve_plan(model, roomy, num_blocks=4, tied=sizes.tied)
    host = result.best.memory.host
    state = host["master_weights"] + host["optimizer_state"]
    # a sixteenth of the state must move (in this tiny model the staging pools, which the planner counts
    # as the runtime allocates them, take almost half of the state: a quarter cannot fit)
    # (the need: categories, CPU activations, the process; the leanest plan's, less a sixteenth)
    budget = _leanest_host_need(model, roomy, sizes, result.best.host_need, state // 64) - state // 16
    with pytest.raises(PlanDoesNotFitError):
        resolve_plan(model, tinypipe.Config(**work, cpu_memory_bytes=budget), num_blocks=4, tied=sizes.tied)
    cfg = tinypipe.Config(**work, cpu_memory_bytes=budget, offload_dir=str(tmp_path))
    plan, result = resolve_plan(model, cfg, num_blocks=4, tied=sizes.tied)
    assert plan.offload and result.best.plan == plan and result.best.host_need <= budget
    assert {k for _, k in plan.offload} <= {"moments", "master"}
    assert result.ssd is not None and result.ssd.directory == str(tmp_path)
    # hand-set knobs: the same offload set for the same budget, with and without the workload
    manual = tinypipe.Config(**dict(result.config_kwargs(), devices=["cpu"]))
    assert manual.offload_dir == str(tmp_path)
    own, none = resolve_plan(model, manual, num_blocks=4, tied=sizes.tied)
    assert none is None and own == plan
    # hand-set knobs without the workload: no activations are known, so the budget for them is the
    # plan's DRAM-only need (store categories, the CPU entry's pools, the process) less a sixteenth
    bare = tinypipe.Config(devices=["cpu"], pack_size=1, stash="device", offload_dir=str(tmp_path))
    dram, _ = resolve_plan(model, dataclasses.replace(bare, offload_dir=None), num_blocks=4, tied=sizes.tied)
    need = (sum(host_bytes(sizes, dram, batch=0, seq=0, precision="fp32", num_devices=1).values())
            + cpu_pool_bytes(sizes, dram, ["cpu"], "fp32") + HOST_BASELINE_BYTES)
    bare = dataclasses.replace(bare, cpu_memory_bytes=need - state // 16)
    own, _ = resolve_plan(model, bare, num_blocks=4, tied=sizes.tied)
    cats = host_bytes(sizes, own, batch=0, seq=0, precision="fp32", num_devices=1)
    pools = cpu_pool_bytes(sizes, own, ["cpu"], "fp32")
    assert own.offload and sum(cats.values()) + pools + HOST_BASELINE_BYTES <= bare.cpu_memory_bytes
    with pytest.raises(PlanDoesNotFitError, match="even with its training state on the SSD"):
        resolve_plan(model, dataclasses.replace(bare, cpu_memory_bytes=HOST_BASELINE_BYTES), num_blocks=4,
                     tied=sizes.tied)


def test_plan_json_and_description_with_offload() -> None:
    plan = make_plan(4, pack_size=1, micro_batch_size=1, backward_micro_batch_size=1, num_devices=1,
                     prefetch_window=1, stash="host", tied=False)
    off = dataclasses.replace(plan, offload=((1, "master"), (1, "moments"), (2, "moments"), (3, "moments")))
    assert off.describe().endswith(", offload: moments of 3 layers, master of 1")
    assert Plan.from_json(off.to_json()) == off and off != plan
    old = plan.as_dict()
    del old["offload"]  # a plan file written before the SSD tier
    assert Plan.from_json(json.dumps(old)) == plan and Plan.from_json(json.dumps(old)).offload == ()
    assert plan.describe() == "pack 1, micro-batch 1/1 (fwd/bwd), window 1, stash host"
