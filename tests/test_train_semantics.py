"""Training semantics users bring from Hugging Face Trainer: which parameters AdamW decays, and the
algebraic undo of AdamW that exact clipping relies on.

Weight decay: by default no decay on biases and normalization weights (HF's rule, read from the
installed transformers' own ``Trainer.get_decay_parameter_names``); training equals
``torch.optim.AdamW`` with the two groups, fp32, with clipping, on 1 and 2 devices and with the
device-side optimizer; ``decay_all`` gives one group. The undo is checked at steps > 1 with
realistic scales (gradients ~1e-3, moments from several real steps) to tight relative tolerances.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.optim.adamw as torch_adamw

import tinypipe
from model_zoo import FAMILIES, make_batch, make_model
from reference import (
    assert_steps_match,
    compare,
    hf_decay_parameter_names,
    randomize_biases,
    train_both,
    train_reference,
)
from tinypipe.lora import LoraSettings, apply_lora
from tinypipe.models.decompose import Decomposition
from tinypipe.planner.auto import manual_plan
from tinypipe.runtime.optim.adamw import ChunkedAdamW
from tinypipe.runtime.optim.decay import DecayGroups, hf_decay_names
from tinypipe.schedule.ids import download_id

LR, EPS, WD = 1e-3, 1e-6, 0.1
BATCH, SEQ, STEPS = 5, 12, 3


# ---------------------------------------------------------------------------------- the grouping

@pytest.mark.parametrize("family", FAMILIES)
def test_decay_names_are_hf_trainers(family: str) -> None:
    model = make_model(family, layers=2)
    names = hf_decay_names(model)
    assert names == hf_decay_parameter_names(model)
    trainable = {n for n, _ in model.named_parameters()}
    excluded = trainable - names
    assert excluded and all("bias" in n or "norm" in n or "ln_" in n for n in excluded), excluded
    # embeddings (and an untied output embedding) are decayed, as in HF
    assert any("emb" in n or "wte" in n or "wpe" in n for n in names)


def test_decay_names_under_lora_are_hf_trainers() -> None:
    pm = apply_lora(make_model("llama", layers=2), LoraSettings(rank=2, alpha=4.0))
    assert hf_decay_names(pm) == hf_decay_parameter_names(pm)
    assert any("lora_A" in n for n in hf_decay_names(pm))


def _gpt2_decay_groups() -> tuple[torch.nn.Module, Decomposition, DecayGroups]:
    """A one-block GPT-2, its decomposition and HF's decay groups (biases, norms: no decay)."""
    model = make_model("gpt2", layers=1)
    dec = Decomposition(model)
    return model, dec, DecayGroups.build(dec.layers, hf_decay_names(model))


def test_groups_cut_a_layer_into_runs() -> None:
    model, dec, groups = _gpt2_decay_groups()
    block = dec.blocks[0]
    n = block.train_numel
    pieces = groups.pieces(block.index, 0, n)
    assert pieces[0][0] == 0 and pieces[-1][1] == n
    assert all(a < b for a, b, _ in pieces) and all(p[1] == q[0] for p, q in zip(pieces, pieces[1:]))
    assert all(p[2] != q[2] for p, q in zip(pieces, pieces[1:]))  # maximal runs
    flag = torch.zeros(n, dtype=torch.bool)
    for a, b, decayed in pieces:
        flag[a:b] = decayed
    for p in block.trainable_params:
        want = p.name in hf_decay_names(model)
        assert bool(flag[p.offset : p.offset + p.numel].all() if want else
                    not flag[p.offset : p.offset + p.numel].any()), p.name
    # a chunk inside one run is one piece; the embedding (all decayed) is never cut
    a, b, d = pieces[1]
    assert groups.pieces(block.index, a + 1, b - 1) == [(a + 1, b - 1, d)]
    assert groups.pieces(dec.embed.index, 0, dec.embed.train_numel) == [(0, dec.embed.train_numel, True)]
    assert DecayGroups().pieces(block.index, 0, n) == [(0, n, True)]


def test_the_common_case_is_one_fused_call_per_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """weight_decay 0, or a layer without a no-decay run: one fused AdamW call per gradient chunk,
    as before the grouping existed; a mixed layer: two."""
    model = make_model("llama", layers=1)
    dec = Decomposition(model)
    groups = DecayGroups.build(dec.layers, hf_decay_names(model))
    calls: list[int] = []
    real = torch_adamw.adamw

    def counting(params, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(params))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch_adamw, "adamw", counting)
    from tinypipe.memory.host_store import LayerState

    def state(spec):  # type: ignore[no-untyped-def]
        n = spec.train_numel
        return LayerState(spec, torch.randn(n), torch.empty(n), torch.empty(n))

    block, embed = dec.blocks[0], dec.embed
    for wd, spec, want in ((0.0, block, [1]), (WD, embed, [1]), (WD, block, [1, 1])):
        calls.clear()
        s = state(spec)
        ChunkedAdamW(LR, (0.9, 0.999), EPS, wd, groups).step(s, 0, spec.train_numel,
                                                              torch.randn(spec.train_numel), 1, LR)
        assert calls == want, (wd, spec.name, calls)


# ---------------------------------------------------------------------------------- exactness

def _run(family: str, cfg: dict, layers: int = 4) -> tuple[float, float]:
    model = make_model(family, layers=layers)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [make_batch(BATCH, SEQ, seed=i) for i in range(STEPS)]
    engine, ref = train_both(model, model, batches, cfg, lr=LR, eps=EPS, weight_decay=WD)
    out = compare(engine.state_dict(), ref.model, init)
    engine.close()
    return out


CASES = {
    "1dev_clip_triggers": dict(devices=["cpu"], pack_size=2, micro_batch_size=2, max_grad_norm=0.5),
    "2dev_clip_triggers": dict(devices=["cpu"] * 2, pack_size=1, micro_batch_size=2,
                               backward_micro_batch_size=3, max_grad_norm=0.5),
    "2dev_no_clip_host_stash": dict(devices=["cpu"] * 2, pack_size=2, micro_batch_size=3, stash="host"),
    "device_optimizer_clip": dict(devices=["cpu"], pack_size=2, micro_batch_size=2, max_grad_norm=0.5,
                                  device_optimizer="both", resident_packs=1),
}


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
@pytest.mark.parametrize("name", list(CASES))
def test_no_decay_groups_match_torch_adamw_with_two_groups(family: str, name: str) -> None:
    worst, update_err = _run(family, dict(CASES[name]))
    assert worst <= 1e-5, f"max per-tensor relative weight error {worst:.2e}"
    assert update_err <= 1e-4, f"relative error of the update {update_err:.2e}"


def test_decay_all_matches_one_group_and_the_groups_are_distinguishable() -> None:
    worst, update_err = _run("gpt2", dict(CASES["1dev_clip_triggers"], decay_all=True))
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    # the tolerance sees the difference: decay_all against the two-group reference fails it
    model = make_model("gpt2", layers=4)
    randomize_biases(model)
    batches = [make_batch(BATCH, SEQ, seed=i) for i in range(STEPS)]
    ref = train_reference(model, batches, lr=LR, eps=EPS, weight_decay=WD, max_grad_norm=0.5)
    cfg = tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD, decay_all=True, head_chunk_tokens=7,
                          **CASES["1dev_clip_triggers"])
    init = {k: v.clone() for k, v in model.state_dict().items()}
    with tinypipe.Engine(model, cfg) as engine:
        for b in batches:
            engine.step(b)
        worst, _ = compare(engine.state_dict(), ref.model, init)
    assert worst > 1e-4, worst


def test_checkpoint_records_the_grouping_and_refuses_another(tmp_path) -> None:  # type: ignore
    cfg = dict(devices=["cpu"], pack_size=2, micro_batch_size=2, lr=LR, weight_decay=WD)
    with tinypipe.Engine(make_model("gpt2", layers=2), tinypipe.Config(**cfg)) as engine:
        engine.step(make_batch(4, 8))
        engine.save_checkpoint(tmp_path / "ckpt")
    with tinypipe.Engine(make_model("gpt2", layers=2), tinypipe.Config(decay_all=True, **cfg)) as other:
        assert any("weight-decay grouping" in d for d in other.checkpoint_differences(tmp_path / "ckpt"))
        with pytest.raises(tinypipe.ConfigError, match="weight-decay grouping"):
            other.load_checkpoint(tmp_path / "ckpt")
        other.load_checkpoint(tmp_path / "ckpt", force=True)
    with tinypipe.Engine(make_model("gpt2", layers=2), tinypipe.Config(**cfg)) as same:
        assert same.checkpoint_differences(tmp_path / "ckpt") == []
        same.load_checkpoint(tmp_path / "ckpt")


# ---------------------------------------------------------------------------------- the undo

class _State:
    """The LayerState fields the optimizer touches."""

    def __init__(self, master: torch.Tensor, spec: object = None) -> None:
        self.master = master
        self.exp_avg = torch.empty_like(master)
        self.exp_avg_sq = torch.empty_like(master)
        self.spec = spec


def _realistic(n: int, steps: int, seed: int = 0) -> tuple[_State, ChunkedAdamW, torch.Generator]:
    """Weights ~0.02, gradients ~1e-3 (per-element scales spread over a decade), moments from
    ``steps`` real AdamW steps."""
    g = torch.Generator().manual_seed(seed)
    opt = ChunkedAdamW(LR, (0.9, 0.999), 1e-8, WD)
    s = _State(torch.randn(n, generator=g) * 0.02)
    scale = 1e-3 * 10 ** (torch.rand(n, generator=g) - 0.5)
    for step in range(1, steps + 1):
        opt.step(s, 0, n, torch.randn(n, generator=g) * scale, step, LR)  # type: ignore[arg-type]
    s.scale = scale  # type: ignore[attr-defined]
    return s, opt, g


ULP = 2.0**-24  # float32's unit roundoff


def _stepped(s: _State, grad: torch.Tensor, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Step ``s`` (number ``step``) and return the state before and, per tensor, the scale of the
    operands its undo combines: the undo cannot be more exact than the rounding of the stepped
    values it starts from (``undo = (new - contribution) / factor`` loses ``new``'s last bits), so
    an element's error is measured in roundings of those operands -- tight where it matters, and
    blind to nothing: a relative bound on ``old`` alone would reject the inherent cancellation
    where ``old`` is tiny against the step's contribution (a second moment after a near-zero
    first gradient)."""
    b1, b2 = 0.9, 0.999
    before = [t.clone() for t in (s.master, s.exp_avg, s.exp_avg_sq)]
    opt = ChunkedAdamW(LR, (b1, b2), 1e-8, WD)
    opt.step(s, 0, grad.numel(), grad, step, LR)  # type: ignore[arg-type]
    m, v = s.exp_avg, s.exp_avg_sq
    update = LR * (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + 1e-8)
    scales = [(s.master.abs() + update.abs()) / (1 - LR * WD),
              (m.abs() + (1 - b1) * grad.abs()) / b1,
              (v + (1 - b2) * grad * grad) / b2]
    return before, scales


def _undo_errors(s: _State, before: list[torch.Tensor], scales: list[torch.Tensor]) -> list[float]:
    """Per tensor: the worst element error in roundings of its operands, and the error of the
    whole vector relative to its norm."""
    out = []
    for t, b, scale in zip((s.master, s.exp_avg, s.exp_avg_sq), before, scales):
        out.append(float(((t - b).abs() / (ULP * scale).clamp_min(1e-38)).max()))
        out.append(float((t - b).norm() / b.norm()))
    return out


@pytest.mark.parametrize("step", [2, 5, 20])
def test_undo_at_later_steps_with_realistic_scales(step: int) -> None:
    n = 4096
    s, opt, g = _realistic(n, step - 1)
    grad = torch.randn(n, generator=g) * s.scale  # type: ignore[attr-defined]
    before, scales = _stepped(s, grad, step)
    moved = float(((s.master - before[0]).abs() / before[0].abs()).median())
    assert moved > 1e-3  # the step changed the weights far beyond the tolerances below
    opt.undo(s, 0, n, grad, step, LR)  # type: ignore[arg-type]
    p_ulps, p_rel, m_ulps, m_rel, v_ulps, v_rel = _undo_errors(s, before, scales)
    # every element within a few roundings of its operands; every vector to 1e-6 relative
    assert max(p_ulps, m_ulps, v_ulps) <= 4, (p_ulps, m_ulps, v_ulps)
    assert max(p_rel, m_rel, v_rel) <= 1e-6, (p_rel, m_rel, v_rel)


def test_undo_tolerances_catch_a_slightly_wrong_gradient() -> None:
    """The same bounds fail when the undo is given a gradient off by 1%: they cannot hide the
    errors the old atol did (10x at gradients ~1e-3)."""
    n = 4096
    s, opt, g = _realistic(n, 4)
    grad = torch.randn(n, generator=g) * s.scale  # type: ignore[attr-defined]
    before, scales = _stepped(s, grad, 5)
    opt.undo(s, 0, n, grad * 1.01, 5, LR)  # type: ignore[arg-type]
    p_ulps, p_rel, m_ulps, m_rel, v_ulps, v_rel = _undo_errors(s, before, scales)
    assert m_ulps > 1e3 and v_ulps > 1e3 and m_rel > 1e-3 and v_rel > 1e-4, (m_ulps, v_ulps, m_rel, v_rel)


def test_undo_honours_the_no_decay_runs() -> None:
    _, dec, groups = _gpt2_decay_groups()
    spec = dec.blocks[0]
    n = spec.train_numel
    g = torch.Generator().manual_seed(3)
    opt = ChunkedAdamW(LR, (0.9, 0.999), 1e-8, WD, groups)
    s = _State(torch.randn(n, generator=g) * 0.02, spec)
    for step in range(1, 4):
        opt.step(s, 0, n, torch.randn(n, generator=g) * 1e-3, step, LR)  # type: ignore[arg-type]
    before = [t.clone() for t in (s.master, s.exp_avg, s.exp_avg_sq)]
    grad = torch.randn(n, generator=g) * 1e-3
    # stepped in two chunks that cut runs, undone whole: the same as one step
    cut = n // 3
    opt.step(s, 0, cut, grad[:cut], 4, LR)  # type: ignore[arg-type]
    opt.step(s, cut, n, grad[cut:], 4, LR)  # type: ignore[arg-type]
    m, v = s.exp_avg, s.exp_avg_sq
    update = LR * (m / (1 - 0.9**4)) / ((v / (1 - 0.999**4)).sqrt() + 1e-8)
    scale = (s.master.abs() + update.abs()) / (1 - LR * WD)
    opt.undo(s, 0, n, grad, 4, LR)  # type: ignore[arg-type]
    # within a few roundings everywhere: dividing a no-decay run by (1 - lr * wd) would be off by
    # lr * wd = 1e-4 relative, ~400 roundings
    ulps = float(((s.master - before[0]).abs() / (ULP * scale).clamp_min(1e-38)).max())
    assert ulps <= 4, ulps
    assert float((s.exp_avg_sq - before[2]).norm() / before[2].norm()) <= 1e-6


# ---------------------------------------------------------------------------------- nonfinite="raise"

def _embedding_grad_inf(engine: tinypipe.Engine):  # type: ignore[no-untyped-def]
    """Only the embedding's gradient becomes non-finite (the loss stays finite): the head and every
    block have been stepped by the time it shows up."""
    def fault(t) -> None:  # type: ignore[no-untyped-def]
        if t.id == download_id(0):
            engine.devices[0].pool.grads(0, None)[0] = float("inf")
    return fault


def _raise_run(tmp_path, clip: float | None):  # type: ignore[no-untyped-def]
    model = make_model("llama", layers=4)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [make_batch(BATCH, SEQ, seed=i) for i in range(3)]
    ref = train_reference(model, [batches[0], batches[2]], lr=LR, eps=EPS, weight_decay=WD,
                          max_grad_norm=clip)
    cfg = tinypipe.Config(devices=["cpu"], pack_size=1, micro_batch_size=2, lr=LR, eps=EPS, weight_decay=WD,
                          max_grad_norm=clip, nonfinite="raise", head_chunk_tokens=7)
    engine = tinypipe.Engine(model, cfg)
    engine.step(batches[0])
    engine.save_checkpoint(tmp_path / "ckpt")
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.fault = _embedding_grad_inf(engine)
    with pytest.raises(tinypipe.NonFiniteError) as info:
        engine.step(batches[1])
    engine.fault = None
    assert engine.step_count == 1
    return engine, ref, init, before, " ".join(str(info.value).split())


def test_raise_with_retained_gradients_rolls_back_and_goes_on(tmp_path) -> None:  # type: ignore
    engine, ref, init, before, msg = _raise_run(tmp_path, clip=100.0)  # never clips: it speculates
    assert "embed" in msg and "rolled back" in msg, msg
    for k, v in engine.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=1e-6, atol=1e-9)
    assert [s.step for s in engine.store.layers] == [1] * len(engine.store.layers)
    engine.step(make_batch(BATCH, SEQ, seed=2))  # as if the bad batch had never been seen
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    engine.close()


def test_raise_without_retained_gradients_refuses_a_mixed_state(tmp_path) -> None:  # type: ignore
    engine, ref, init, before, msg = _raise_run(tmp_path, clip=None)
    assert "head" in msg and "already took this step's update" in msg and "load_checkpoint" in msg, msg
    changed = [k for k, v in engine.state_dict().items() if not torch.equal(v, before[k])]
    assert changed and not any(k.startswith("model.embed") for k in changed)  # what the message says
    with pytest.raises(tinypipe.NonFiniteError, match="mixes two steps"):
        engine.step(make_batch(BATCH, SEQ, seed=2))
    with pytest.raises(tinypipe.NonFiniteError, match="refusing to checkpoint"):
        engine.save_checkpoint(tmp_path / "ckpt")
    engine.load_checkpoint(tmp_path / "ckpt")  # consistent again: training goes on exactly
    engine.step(make_batch(BATCH, SEQ, seed=2))
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    engine.close()


def test_raise_on_a_nonfinite_loss_updates_nothing_and_stays_usable() -> None:
    engine = tinypipe.Engine(make_model("llama", layers=2),
                             tinypipe.Config(devices=["cpu"], pack_size=1, micro_batch_size=2, lr=LR))
    engine.step(make_batch(4, 8))
    with torch.no_grad():
        engine.state_dict()["model.layers.1.mlp.down_proj.weight"][0, 0] = float("inf")
    with pytest.raises(tinypipe.NonFiniteError, match="no layer was updated"):
        engine.step(make_batch(4, 8, seed=1))
    with torch.no_grad():
        engine.state_dict()["model.layers.1.mlp.down_proj.weight"][0, 0] = 0.0
    assert engine.step(make_batch(4, 8, seed=1)).step == 2
    engine.close()


def _batches_clipping_at_step_4(model: torch.nn.Module) -> tuple[list[dict], list[float]]:
    """Four batches, the fourth's reference gradient norm above the first three's (a clip threshold
    of 0.99 x it triggers only there), and the reference norms."""
    first = [make_batch(BATCH, SEQ, seed=i) for i in range(3)]
    for seed in range(3, 40):
        batches = first + [make_batch(BATCH, SEQ, seed=seed)]
        norms = train_reference(model, batches, lr=LR, eps=EPS, weight_decay=WD).grad_norms
        if norms[3] * 0.99 > max(norms[:3]):
            return batches, norms
    pytest.fail("no fourth batch with a larger gradient norm")


def _count_undos(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The layer of every ChunkedAdamW.undo call from now on (the calls still run)."""
    undone: list[int] = []
    real = ChunkedAdamW.undo

    def counting(self, state, *args, **kwargs):  # type: ignore[no-untyped-def]
        undone.append(state.spec.index)
        return real(self, state, *args, **kwargs)

    monkeypatch.setattr(ChunkedAdamW, "undo", counting)
    return undone


def test_engine_rollback_at_a_later_step_matches_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three unclipped steps, then a step whose norm just exceeds the threshold: nearly every layer
    was stepped speculatively at step 4 (moments from three real steps) and is undone and redone
    clipped. Weights match torch's clipped AdamW to the usual tolerance."""
    model = make_model("llama", layers=4)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches, norms = _batches_clipping_at_step_4(model)
    undone = _count_undos(monkeypatch)
    cfg = dict(devices=["cpu"], pack_size=1, micro_batch_size=2, max_grad_norm=0.99 * norms[3])
    engine, ref = train_both(model, model, batches, cfg, lr=LR, eps=EPS, weight_decay=WD)
    worst, update_err = compare(engine.state_dict(), ref.model, init)  # waits for the redo
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    assert len(set(undone)) >= 4, undone  # the rollback ran at step 4, over most layers
    engine.close()


# ---------------------------------------------------------------------------------- with the SSD tier

def _ssd_run(model: torch.nn.Module, cfg: tinypipe.Config, kinds: tuple[str, ...],
             batches: list[dict]) -> tuple[tinypipe.Engine, list]:
    """An engine whose plan puts ``kinds`` of every layer on the SSD (none: all in DRAM), stepped
    over ``batches``."""
    plan = manual_plan(cfg, num_blocks=4, tied=bool(model.config.tie_word_embeddings))
    plan = replace(plan, offload=tuple((layer, k) for layer in range(6) for k in kinds))
    engine = tinypipe.Engine(model, cfg, plan=plan)
    return engine, [engine.step(b) for b in batches]


@pytest.mark.parametrize("kinds", [("moments",), ("master", "moments", "grad")], ids="+".join)
def test_decay_groups_undo_and_checkpoints_with_state_on_the_ssd(  # type: ignore
        tmp_path, kinds, monkeypatch) -> None:
    """Masters, moments and retained gradients on the SSD (the optimizer steps staging buffers):
    the no-decay groups give torch's two-group AdamW, the undo at step 4 (three real steps of
    moments, read back from the SSD) honours them, every number equals the DRAM engine's bit for
    bit, and a checkpoint of the SSD engine records the grouping (another one is refused)."""
    model = make_model("llama", layers=4)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches, norms = _batches_clipping_at_step_4(model)
    clip = 0.99 * norms[3]
    ref = train_reference(model, batches, lr=LR, eps=EPS, weight_decay=WD, max_grad_norm=clip)
    undone = _count_undos(monkeypatch)
    cfg = tinypipe.Config(devices=["cpu"], pack_size=2, micro_batch_size=2, lr=LR, eps=EPS, weight_decay=WD,
                          max_grad_norm=clip, head_chunk_tokens=7)
    ssd_cfg = cfg.replace(offload_dir=str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    dram, rd = _ssd_run(copy.deepcopy(model), cfg, (), batches)
    undone.clear()
    ssd, rs = _ssd_run(copy.deepcopy(model), ssd_cfg, kinds, batches)
    try:
        assert sum(r.ssd_read_bytes for r in rs) > 0 and all(r.ssd_read_bytes == 0 for r in rd)
        assert_steps_match(rs, ref, clip)
        ssd.synchronize()  # the rollback is leftover work: it runs while the next step would start
        assert rs[3].clipped and len(set(undone)) >= 4, undone  # the rollback ran at step 4, from the SSD
        assert ssd.optimizer.adamw.groups.no_decay  # biases and norm weights: runs without decay
        worst, update_err = compare(ssd.state_dict(), ref.model, init)
        assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
        assert [(r.loss, r.grad_norm) for r in rs] == [(r.loss, r.grad_norm) for r in rd]
        sd, ss = dram.state_dict(), ssd.state_dict()
        assert all(torch.equal(ss[k], sd[k]) for k in sd)
        od, oss = dram.optimizer_state(), ssd.optimizer_state()
        for name in od:
            assert torch.equal(od[name]["exp_avg"], oss[name]["exp_avg"]), name
            assert torch.equal(od[name]["exp_avg_sq"], oss[name]["exp_avg_sq"]), name
        ssd.save_checkpoint(tmp_path / "ckpt")
    finally:
        dram.close()
        ssd.close()
    other_cfg = ssd_cfg.replace(decay_all=True)
    other, _ = _ssd_run(make_model("llama", layers=4), other_cfg, kinds, [])
    with other:
        with pytest.raises(tinypipe.ConfigError, match="weight-decay grouping"):
            other.load_checkpoint(tmp_path / "ckpt")
    same, _ = _ssd_run(make_model("llama", layers=4), ssd_cfg, kinds, [])
    with same:
        assert same.checkpoint_differences(tmp_path / "ckpt") == []
        same.load_checkpoint(tmp_path / "ckpt")
        loaded = same.state_dict()
        assert all(torch.equal(loaded[k], ss[k]) for k in ss)
    assert not list((tmp_path / "scratch").iterdir()), "scratch left behind after close"
