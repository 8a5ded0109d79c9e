"""Host-stashed pack inputs on the SSD (``Plan.stash_on_ssd``, ``runtime/ssd_stash.py``, issue #32):
at long sequences, when host memory cannot hold every ``[B, S, H]`` stash, the planner puts the
earliest packs' inputs in the offload directory's files; the forward writes their rows there, the
backward reads them back (ahead of need), and a boundary's gradient reuses the same rows where
``host_gradient_boundaries`` says so.

Training over real files (tmp_path), MLPs chunked (long-sequence mode at tiny scale): bit-identical
to the same plan with host stashes and plain PyTorch within 1e-5 (tests/reference.py), over several
micro-batchings and packings; a read of another micro-batch's or boundary's rows fails; the bytes
really went through the files. The planner's choice, host bytes and refusals at the 8B shape."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from reference import randomize_biases, train_plan_against_reference
from tinypipe.errors import ConfigError
from tinypipe.schedule.plan import Plan, host_gradient_boundaries, make_plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BATCH, SEQ, STEPS = 5, 16, 3
CHUNK = 5


def _config(tmp_path, devices: int = 1, **kw) -> tinypipe.Config:  # type: ignore[no-untyped-def]
    tmp_path.mkdir(parents=True, exist_ok=True)
    return tinypipe.Config(devices=["cpu"] * devices, lr=1e-3, eps=1e-6, weight_decay=0.1, head_chunk_tokens=7,
                           mlp_chunk_tokens=CHUNK, offload_dir=str(tmp_path), **kw)


def _plan(model, pack, fwd: int, bwd: int, ssd: tuple[int, ...], keep=False, devices: int = 1) -> Plan:  # type: ignore[no-untyped-def]
    n = int(model.config.num_hidden_layers)
    plan = make_plan(n, pack_size=pack, micro_batch_size=fwd, backward_micro_batch_size=bwd, num_devices=devices,
                     prefetch_window=1, stash="host", tied=bool(model.config.tie_word_embeddings),
                     keep_activations=keep)
    return dataclasses.replace(plan, stash_on_ssd=ssd)


def _batches() -> list[dict]:
    return [make_batch(BATCH, SEQ, seed=i, pad=i == 1) for i in range(STEPS)]


def _host_run(family: str, plan: Plan, tmp_path) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    model = make_model(family)
    torch.manual_seed(0)
    randomize_biases(model)
    engine = tinypipe.Engine(model, _config(tmp_path, plan.num_devices), plan=dataclasses.replace(plan, stash_on_ssd=()))
    for b in _batches():
        engine.step(b)
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    return state


CASES = {
    # (family, pack size, fwd micro-batch, bwd micro-batch, SSD boundaries, keep)
    "qwen2_mb1-2_two": ("qwen2", 1, 1, 2, (1, 2), False),  # gradient in the SSD rows, 2 fwd mbs per bwd
    "llama_mb2-2_one": ("llama", 1, 2, 2, (1,), False),  # rows 2, 2, 1: a partly filled slot
    "qwen2_mb2-1_all": ("qwen2", 1, 2, 1, (1, 2, 3), False),  # bwd splits fwd: gradients on the device
    "llama_pack2": ("llama", 2, 1, 1, (1,), False),  # two packs of 2 blocks
    "qwen2_kept": ("qwen2", 1, 1, 1, (1,), [False, False, True, False]),  # a kept pack among them
    "llama_2dev": ("llama", 1, 1, 2, (1, 2), False),  # two devices: written on one, read on another
}
DEVICES = {"llama_2dev": 2}


@pytest.mark.parametrize("case", list(CASES))
def test_training_matches_host_stashes_and_pytorch(case: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    family, pack, fwd, bwd, ssd, keep = CASES[case]
    model = make_model(family)
    n = DEVICES.get(case, 1)
    plan = _plan(model, pack, fwd, bwd, ssd, keep, n)
    assert plan.stash_on_ssd == ssd
    engine, results = train_plan_against_reference(model, plan, _batches(), _config(tmp_path / "ssd", n))
    stash = engine.resources.ssd_stash
    assert stash is not None and stash.store is not None
    # the files exist under the offload directory while the engine runs, and the bytes went through them
    assert all(p.exists() and str(p).startswith(str(tmp_path / "ssd")) for p in stash.store.paths)
    H = int(model.config.hidden_size)
    bsh = BATCH * SEQ * H * 4
    grads = sum(host_gradient_boundaries(plan, True)[q] for q in ssd)
    # per step and SSD boundary: written by the forward, read by the forward and the backward;
    # a gradient in its rows written by the backward and read by the previous pack's backward
    assert stash.write_bytes == STEPS * (len(ssd) + grads) * bsh
    assert stash.read_bytes == STEPS * (2 * len(ssd) + grads) * bsh
    assert stash.store.stats.totals().read_bytes >= stash.read_bytes
    # the step's result reports them as SSD traffic
    assert all(r.ssd_write_bytes == (len(ssd) + grads) * bsh for r in results)
    assert all(r.ssd_read_bytes == (2 * len(ssd) + grads) * bsh for r in results)
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    paths = stash.store.paths
    engine.close()
    assert not any(p.exists() for p in paths)  # scratch removed at close
    host = _host_run(family, plan, tmp_path / "host")
    assert all(torch.equal(state[k], host[k]) for k in host), case  # bit for bit


@pytest.mark.parametrize("wrong", ["micro_batch", "boundary"])
def test_reading_other_rows_fails(wrong: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The same run with reads of another micro-batch's row (the next one) or another boundary's
    (boundary 2 reads boundary 1's rows, both written by then): PyTorch's tolerances fail."""
    from tinypipe.runtime import ssd_stash as module

    if wrong == "micro_batch":
        def region(q: int, r: int) -> tuple[int, int]:
            return q, (r + 1) % BATCH
    else:
        def region(q: int, r: int) -> tuple[int, int]:
            return 1, r
    real = module.SsdStash.__init__

    def sabotaged(self, *a, **k):  # type: ignore[no-untyped-def]
        real(self, *a, **k)
        self.read_region = region

    monkeypatch.setattr(module.SsdStash, "__init__", sabotaged)
    model = make_model("qwen2")
    with pytest.raises(AssertionError):
        train_plan_against_reference(model, _plan(model, 1, 1, 2, (1, 2)), _batches(), _config(tmp_path))


def test_memory_report_counts_the_staging_pool(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The memory report's ``ssd_stash_staging`` (pool + the store's bounce pages) and its
    ``stashed_activations`` (the host-memory stashes left) equal the planner's host_bytes."""
    from tinypipe.planner.estimate import host_bytes
    from tinypipe.planner.sizes import model_sizes
    from tinypipe.storage import stash_layout

    model = make_model("llama")
    plan = _plan(model, 1, 1, 2, (1, 2))
    engine = tinypipe.Engine(model, _config(tmp_path), plan=plan)
    engine.step(make_batch(BATCH, SEQ))
    report = engine.memory_report().host
    est = host_bytes(model_sizes(model.config), plan, batch=BATCH, seq=SEQ, precision="fp32", num_devices=1,
                     mlp_chunk=CHUNK)
    H = int(model.config.hidden_size)
    assert report["ssd_stash_staging"] == est["ssd_stash_staging"] == stash_layout.staging_bytes(
        2, batch=BATCH, seq=SEQ, hidden=H, itemsize=4, micro_batch_size=1, backward_micro_batch_size=2)
    # boundaries 0 (the embedding's output) and 3 stay in host memory
    assert report["stashed_activations"] == est["stashed_activations"] == 2 * BATCH * SEQ * H * 4
    engine.close()


def test_plan_field_checks_and_round_trip() -> None:
    model = make_model("llama")
    plan = _plan(model, 1, 1, 1, (2, 1))
    assert plan.stash_on_ssd == (1, 2)
    assert Plan.from_json(plan.to_json()) == plan
    assert "2 pack inputs on the SSD (1,2)" in plan.describe()
    for bad in [(0,), (4,)]:
        with pytest.raises(ConfigError, match="stash_on_ssd"):
            _plan(model, 1, 1, 1, bad)
    with pytest.raises(ConfigError, match="stash_on_ssd"):  # a kept pack reads no stash
        _plan(model, 1, 1, 1, (2,), [False, False, True, False])
    old = Plan.from_json(_plan(model, 1, 1, 1, ()).to_json().replace('"stash_on_ssd": [],', ""))
    assert old.stash_on_ssd == ()  # plans written before the field


# ---------------------------------------------------------------- the planner at the 8B shape

GiB = 1024**3
_EV: list = [None]  # the last _settle's evaluate


def _settle(seq: int, cpu_gib: float, free_gib: float | None = None, lora: bool = True):  # type: ignore[no-untyped-def]
    """A hand-set plan (pack 1, micro-batch 1, host stash) for 2 x ``seq`` tokens of the
    Llama-3.1-8B shape, QLoRA NF4, settled by the SSD tier under ``cpu_gib`` of host memory."""
    from tinypipe.lora.settings import LoraSettings
    from tinypipe.planner.hardware import load_hardware
    from tinypipe.planner.presets import load_model_config
    from tinypipe.planner.search import evaluate
    from tinypipe.planner.sizes import lora_sizes, model_sizes
    from tinypipe.planner.spill import Spill
    from tinypipe.planner.ssd import SsdSpec

    cfg = load_model_config("llama-3.1-8b")
    s = lora_sizes(cfg, LoraSettings(rank=16, alpha=32.0, quantize="nf4", compute_dtype="bf16")) if lora \
        else model_sizes(cfg)
    ssd = SsdSpec(1.6, 2.4, source="stated", free_bytes=None if free_gib is None else int(free_gib * GiB))
    hw = ssd.apply(load_hardware("h200-pcie5"))
    plan = make_plan(s.num_blocks, pack_size=1, micro_batch_size=1, backward_micro_batch_size=1, num_devices=1,
                     prefetch_window=1, stash="host", tied=s.tied)
    chunk = 8192 if seq > 16384 else 0

    def ev(p, peaks=None):  # type: ignore[no-untyped-def]
        return evaluate(s, hw, p, seq=seq, global_batch=2, precision="bf16", max_grad_norm=None,
                        host_grad_buffers=None, peaks=peaks, mlp_chunk=chunk)

    _EV[0] = ev
    spill = Spill(s, ssd, int(cpu_gib * GiB), precision="bf16", retain_grads=False, mlp_chunk=chunk)
    c = ev(plan)
    return c, spill.settle(c, ev), spill, s


def test_planner_moves_the_earliest_pack_inputs() -> None:
    """2 x 256K QLoRA under 128 GiB: refused today (the stashes alone are 33 x 4 GiB); settled,
    the first packs' inputs go to the SSD -- as few as fit -- and host bytes count a staging pool
    for them instead of their buffers; the time model has their SSD traffic."""
    from tinypipe.storage import stash_layout

    c, settled, _, s = _settle(256 * 1024, 128)
    ev_of = _EV[0]
    assert c.host_need > 128 * GiB
    assert settled is not None and settled.host_need <= 128 * GiB
    k = len(settled.plan.stash_on_ssd)
    assert settled.plan.stash_on_ssd == tuple(range(1, k + 1)) and 0 < k < s.num_blocks - 1
    bsh = 2 * 256 * 1024 * s.hidden * 2
    host = settled.memory.host
    assert host["stashed_activations"] == c.memory.host["stashed_activations"] - k * bsh
    assert host["ssd_stash_staging"] == stash_layout.staging_bytes(
        k, batch=2, seq=256 * 1024, hidden=s.hidden, itemsize=2, micro_batch_size=1, backward_micro_batch_size=1)
    # one fewer would not fit even with all training state on the SSD: the choice is the fewest
    from tinypipe.planner.candidate import HOST_BASELINE_BYTES
    from tinypipe.planner.estimate import store_and_beside
    from tinypipe.planner.spill import choose_spill

    fewer = dataclasses.replace(settled.plan, stash_on_ssd=settled.plan.stash_on_ssd[:-1], offload=())
    cats, fixed = store_and_beside(ev_of(fewer).memory)
    offload, need = choose_spill(s, fewer, cats, HOST_BASELINE_BYTES + fixed, 128 * GiB, precision="bf16",
                                 retain_grads=False)
    assert offload is None and need > 128 * GiB
    # per step: each input written once, read twice, its gradient written and read once
    assert settled.time.ssd_write_bytes >= 2 * k * bsh and settled.time.ssd_read_bytes >= 3 * k * bsh


def test_planner_refuses_in_one_line() -> None:
    """Too little DRAM even with every stash on the SSD, or too little disk for them: one line
    that says what it would need."""
    _, settled, spill, _ = _settle(256 * 1024, 8)
    assert settled is None
    why = spill.why_not()
    assert why is not None and "\n" not in why and why.startswith("needs ") and "host memory" in why
    assert "pack inputs on the SSD" in why, why
    _, settled, spill, _ = _settle(256 * 1024, 128, free_gib=4)
    assert settled is None
    why = spill.why_not()
    assert why is not None and "\n" not in why and "SSD scratch space" in why and "4.0 GiB free" in why


def test_short_sequences_never_stash_on_the_ssd() -> None:
    """Without chunked MLPs the SSD takes only optimizer state, as before."""
    _, settled, spill, _ = _settle(2048, 4, lora=False)
    assert settled is None or not settled.plan.stash_on_ssd


def test_a_write_that_cannot_be_issued_stops_the_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A write the I/O thread could not issue would leave the last step's rows in the file: the
    step stops (one line naming the stash) instead of reading them."""
    from tinypipe.errors import WorkerError

    model = make_model("llama")
    engine = tinypipe.Engine(model, _config(tmp_path), plan=_plan(model, 1, 1, 1, (1,)))
    engine.step(make_batch(BATCH, SEQ))
    store = engine.resources.ssd_stash.store

    def broken(*a, **k):  # type: ignore[no-untyped-def]
        raise OSError("disk gone")

    store.write_async = broken
    with pytest.raises((WorkerError, RuntimeError), match="SSD stash write could not be issued"):
        engine.step(make_batch(BATCH, SEQ, seed=1))
    engine.close()
