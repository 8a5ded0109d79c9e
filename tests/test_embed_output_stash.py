"""The embedding's output and its gradient in host memory at long sequences (issue #32,
``schedule/plan.py`` host_stashed_inputs / host_gradient_boundaries, boundary 0).

With the MLPs in chunks (forced here on a tiny model: ``mlp_chunk_tokens`` 5) and pack 1's input
stashed on the host, the embedding's forward writes its output into a host stash buffer one forward
micro-batch at a time, pack 0 reads it back as other packs read theirs, pack 0's backward writes
the embedding's input gradient into the same rows and the embedding's backward reads them one
forward micro-batch at a time. Checked here: that this is what runs (the buffers, the memory
report, the traffic, the embedding's recompute per micro-batch), that training equals plain
PyTorch (fp32, three steps; 1e-5 per tensor, 1e-4 of the update, as tests/test_long_context.py)
for several micro-batchings and packings, tied embeddings, learned positions (GPT-2), packed
documents and two devices, that dropout after the embedding is replayed (the whole batch at once)
as with the buffer on the device, that reading another micro-batch's rows fails those tolerances,
and that the planner's estimate moves the two buffers from the device to the host."""

from __future__ import annotations

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from reference import compare, randomize_biases, train_both
from tinypipe.models.shell import Shell
from tinypipe.runtime.stash_io import StashIO
from tinypipe.schedule import plan as plan_module
from tinypipe.schedule.plan import host_gradient_boundaries, host_stashed_inputs, make_plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LR, EPS, WD = 1e-3, 1e-6, 0.1
BATCH, SEQ, STEPS = 5, 16, 3
CHUNK = 5  # tokens per MLP chunk: long-sequence mode on a tiny model


# ---------------------------------------------------------------- the rule


def _plan(**kw) -> plan_module.Plan:  # type: ignore[no-untyped-def]
    args = dict(pack_size=1, micro_batch_size=2, backward_micro_batch_size=2, num_devices=1,
                prefetch_window=1, stash="host", tied=False)
    args.update(kw)
    return make_plan(4, **args)  # type: ignore[arg-type]


def test_the_embedding_output_is_host_stashed_only_at_long_sequences() -> None:
    host = _plan()
    assert host_stashed_inputs(host, False) == (False, True, True, True, False)  # as stash_on_host
    assert host_stashed_inputs(host, True) == (True, True, True, True, False)
    assert host_gradient_boundaries(host, False) == (False,) * 5
    assert host_gradient_boundaries(host, True) == (True, True, True, True, False)
    # stash on the device, pack 0 keeping its graph, one pack only: the output stays on the device
    assert not host_stashed_inputs(_plan(stash="device"), True)[0]
    assert not host_stashed_inputs(_plan(keep_activations=[True, False, False, False]), True)[0]
    assert host_stashed_inputs(_plan(pack_size=4), True) == (False, False)
    # backward micro-batches that split forward ones: the output in host memory, its gradient not
    split = _plan(backward_micro_batch_size=3)
    assert host_stashed_inputs(split, True)[0] and not host_gradient_boundaries(split, True)[0]


# ---------------------------------------------------------------- what runs


def _spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Per step the runtime's boundary-0 placement (output, gradient), and the rows of every
    embedding forward (the embedding's forward, then its backward's recomputes)."""
    seen: dict[str, list] = {"inputs": [], "grads": [], "embed_rows": []}
    real_inputs, real_grads, real_embed = host_stashed_inputs, host_gradient_boundaries, Shell.embed_forward

    def inputs(plan, long_sequences):  # type: ignore[no-untyped-def]
        out = real_inputs(plan, long_sequences)
        seen["inputs"].append(out[0])
        return out

    def grads(plan, long_sequences):  # type: ignore[no-untyped-def]
        out = real_grads(plan, long_sequences)
        seen["grads"].append(out[0])
        return out

    def embed(self, input_ids, attention_mask, position_ids=None):  # type: ignore[no-untyped-def]
        seen["embed_rows"].append(int(input_ids.shape[0]))
        return real_embed(self, input_ids, attention_mask, position_ids)

    monkeypatch.setattr("tinypipe.runtime.step.host_stashed_inputs", inputs)
    monkeypatch.setattr("tinypipe.runtime.step.host_gradient_boundaries", grads)
    monkeypatch.setattr(Shell, "embed_forward", embed)
    return seen


def test_the_buffers_live_on_the_host_and_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Boundary 0's buffers are the host stash's (no device buffer: ``owner`` None, the gradient
    in the output's rows), the memory report counts the buffer, the traffic its moves, and the
    embedding's backward recomputes one forward micro-batch at a time."""
    from tinypipe.runtime.step import StepRunner
    from tinypipe.runtime.traffic import step_traffic

    seen = _spy(monkeypatch)
    contexts = []
    real_context = StepRunner.new_context

    def keep(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        ctx = real_context(self, *args, **kwargs)
        contexts.append(ctx)
        return ctx

    monkeypatch.setattr(StepRunner, "new_context", keep)
    model = make_model("llama")
    H = int(model.config.hidden_size)
    engine = tinypipe.Engine(model, tinypipe.Config(devices=["cpu"], pack_size=1, micro_batch_size=2,
                                                    stash="host", mlp_chunk_tokens=CHUNK))
    engine.step(make_batch(BATCH, SEQ))
    ctx = contexts[-1]
    acts0, grads0 = ctx.acts[0], ctx.grads[0]
    assert acts0.owner is None and grads0.owner is None and grads0.tensor is acts0.tensor
    assert acts0.tensor.shape == (BATCH, SEQ, H)
    assert seen["inputs"] == [True] and seen["grads"] == [True]
    # the embedding's forward over the batch, its backward over each forward micro-batch (2, 2, 1)
    assert seen["embed_rows"] == [BATCH, 2, 2, 1]
    bsh = BATCH * SEQ * H * 4
    stashed = host_stashed_inputs(engine.plan, True)
    assert sum(stashed) == sum(engine.plan.stash_on_host) + 1
    assert engine.memory_report().host["stashed_activations"] == sum(stashed) * bsh
    from tinypipe.planner.estimate import host_bytes
    from tinypipe.planner.sizes import model_sizes

    est = host_bytes(model_sizes(model.config), engine.plan, batch=BATCH, seq=SEQ, precision="fp32",
                     num_devices=1, mlp_chunk=CHUNK)
    assert est["stashed_activations"] == sum(stashed) * bsh  # the planner counts the same buffer
    sched = engine.schedule_for(BATCH)
    short = step_traffic(sched, engine.store, SEQ, H, 4, 4)
    long = step_traffic(sched, engine.store, SEQ, H, 4, 4, long_sequences=True)
    grads_on_host = sum(host_gradient_boundaries(engine.plan, True))
    # the embedding's output down once, up twice (pack 0's forward and backward); every host
    # boundary gradient (boundary 0's included) down once and up once
    assert long.d2h_bytes - short.d2h_bytes == bsh + grads_on_host * bsh
    assert long.h2d_bytes - short.h2d_bytes == 2 * bsh + grads_on_host * bsh
    engine.close()


def test_short_runs_keep_the_output_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """No MLP chunks: the embedding's output is adopted on the device as before, one recompute."""
    seen = _spy(monkeypatch)
    engine = tinypipe.Engine(make_model("llama"), tinypipe.Config(devices=["cpu"], pack_size=1,
                                                                  micro_batch_size=2, stash="host"))
    engine.step(make_batch(BATCH, SEQ))
    assert seen["inputs"] == [False] and seen["grads"] == [False] and seen["embed_rows"] == [BATCH, BATCH]
    assert engine.memory_report().host["stashed_activations"] == (
        sum(engine.plan.stash_on_host) * BATCH * SEQ * int(engine.model.config.hidden_size) * 4)
    engine.close()


# ---------------------------------------------------------------- training equals PyTorch


CONFIGS = {
    # one sequence per micro-batch, every pack input on the host
    "pack1_mb1": dict(devices=["cpu"], pack_size=1, micro_batch_size=1, backward_micro_batch_size=1),
    # two blocks per pack, backward micro-batches of two forward ones
    "pack2_mb2_bwd4": dict(devices=["cpu"], pack_size=2, micro_batch_size=2, backward_micro_batch_size=4),
    # a kept pack beside recomputed ones, clipping
    "kept_clip": dict(devices=["cpu"], pack_size=1, micro_batch_size=2,
                      keep_activations=[False, True, False, False], max_grad_norm=0.5),
    # the embedding on device 0, pack 0's forward and backward on device 1
    "two_devices": dict(devices=["cpu", "cpu"], pack_size=[1, 3], micro_batch_size=2,
                        backward_micro_batch_size=2),
    # backward micro-batches that split forward ones: the output on the host, its gradient not
    "split_mb2_bwd3": dict(devices=["cpu"], pack_size=2, micro_batch_size=2, backward_micro_batch_size=3),
}


def _batches(packed: bool, batch: int) -> list[dict[str, torch.Tensor]]:
    if packed:
        from test_long_context import _packed_batches

        return _packed_batches()
    return [make_batch(batch, SEQ, seed=i, pad=i == 1) for i in range(STEPS)]


def _train_and_compare(family: str, cfg: dict, packed: bool = False, batch: int = BATCH) -> None:
    """Three steps through the engine (losses and norms within 1e-5 of plain PyTorch's), then the
    weights: within 1e-5 per tensor, the update within 1e-4."""
    model = make_model(family)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    engine, ref = train_both(model, model, _batches(packed, batch),
                             dict(cfg, stash="host", mlp_chunk_tokens=CHUNK), lr=LR, eps=EPS, weight_decay=WD)
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    engine.close()
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)


@pytest.mark.parametrize("family", ["llama", "qwen2"], ids=["untied", "tied"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_matches_pytorch(family: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy(monkeypatch)
    model_tied = bool(make_model(family).config.tie_word_embeddings)
    assert model_tied == (family == "qwen2")
    _train_and_compare(family, CONFIGS[name])
    assert seen["inputs"] == [True] * STEPS
    split = name == "split_mb2_bwd3"
    assert seen["grads"] == [not split] * STEPS
    if not split:  # the backward's recomputes: one per forward micro-batch
        per_step = 1 + -(-BATCH // CONFIGS[name]["micro_batch_size"])  # type: ignore[operator]
        assert len(seen["embed_rows"]) == STEPS * per_step


@pytest.mark.parametrize("family,packed", [("llama", True), ("gpt2", False)], ids=["packed_docs", "gpt2"])
def test_positions_match_pytorch(family: str, packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Position ids restarting inside rows (sliced per micro-batch in the recompute), and GPT-2's
    learned position embedding (a second embedding parameter)."""
    seen = _spy(monkeypatch)
    _train_and_compare(family, CONFIGS["pack2_mb2_bwd4"], packed=packed)
    assert seen["inputs"] == [True] * STEPS and seen["grads"] == [True] * STEPS


def test_dropout_after_the_embedding_replays_the_whole_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2 with embedding, attention and residual dropout (masks replayed by the recomputes):
    with the embedding's output in host memory its backward recomputes the whole batch at once
    (a micro-batch's recompute would draw other masks), and the weights equal those of the same
    run with every buffer on the device within 1e-6."""
    from test_dropout import gpt2_with_dropout

    def run(stash: str) -> dict[str, torch.Tensor]:
        engine = tinypipe.Engine(gpt2_with_dropout(0.3), tinypipe.Config(
            devices=["cpu"], pack_size=1, micro_batch_size=2, stash=stash, mlp_chunk_tokens=CHUNK,
            lr=LR, eps=EPS, weight_decay=WD, dropout=True, dropout_seed=11))
        for i in range(STEPS):
            engine.step(make_batch(BATCH, SEQ, seed=i))
        state = engine.state_dict()
        engine.close()
        return state

    seen = _spy(monkeypatch)
    host = run("host")
    assert seen["inputs"] == [True] * STEPS and seen["embed_rows"] == [BATCH, BATCH] * STEPS
    device = run("device")
    assert seen["inputs"][STEPS:] == [False] * STEPS
    worst = max(float((host[k] - device[k]).norm()) / max(float(device[k].norm()), 1e-12) for k in device)
    assert worst <= 1e-6, worst


@pytest.mark.parametrize("which", ["output", "gradient"])
def test_reading_another_micro_batchs_rows_fails(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: pack 0 reads the embedding's output (``output``), or the embedding's backward
    reads its input gradient (``gradient``), from the next forward micro-batch's host rows. The
    comparison with PyTorch must fail the tolerances above."""
    real = StashIO.read_rows
    hits = []

    def other_rows(self, buf, lo, hi, dev):  # type: ignore[no-untyped-def]
        target = self.ctx.acts[0] if which == "output" else self.ctx.grads[0]
        batch = self.ctx.inputs.batch
        if buf is target and buf.owner is None and hi - lo < batch:
            hits.append((lo, hi))
            n = hi - lo
            lo = (lo + n) % batch
            hi = lo + n
        return real(self, buf, lo, hi, dev)

    monkeypatch.setattr(StashIO, "read_rows", other_rows)
    cfg = dict(devices=["cpu"], pack_size=2, micro_batch_size=2, backward_micro_batch_size=2)
    with pytest.raises(AssertionError):  # four rows: two forward micro-batches of the same size
        _train_and_compare("llama", cfg, batch=4)
    assert hits, "the sabotage never ran"


# ---------------------------------------------------------------- the planner


def test_the_estimate_moves_both_buffers_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama-3.1-8B shape, 2 x 128K tokens, pack 1, micro-batch 1, host stash, MLP chunks of 8192:
    with boundary 0 kept on the device (the rule patched) the estimate is the old one; moved, the
    device peak (a middle pack's backward, where the output's buffer is alive and the embedding's
    input gradient not yet) falls by the output's buffer, 2 GiB, and the host's stashed
    activations rise by it. Short sequences estimate exactly as before."""
    from tinypipe.planner import estimate
    from tinypipe.planner.presets import load_model_config
    from tinypipe.planner.sizes import model_sizes

    s = model_sizes(load_model_config("llama-3.1-8b"))
    plan = make_plan(s.num_blocks, pack_size=1, micro_batch_size=1, backward_micro_batch_size=1,
                     num_devices=1, prefetch_window=1, stash="host", tied=s.tied)
    B, S = 2, 131072
    long = dict(batch=B, seq=S, precision="bf16", devices=["cuda:0"], mlp_chunk=8192)
    short = dict(long, seq=2048, mlp_chunk=0)

    def estimates() -> tuple:
        return (estimate.estimate_memory(s, plan, **long),
                estimate.activation_peaks(s, plan, detail=True, **long),
                estimate.estimate_memory(s, plan, **short))

    moved, (moved_peaks, moved_where), short_now = estimates()

    def device_boundary_0(plan, long_sequences):  # type: ignore[no-untyped-def]
        return (False,) + host_stashed_inputs(plan, long_sequences)[1:]

    monkeypatch.setattr(estimate, "host_stashed_inputs", device_boundary_0)
    monkeypatch.setattr(plan_module, "host_stashed_inputs", device_boundary_0)  # host_gradient_boundaries'
    kept, (kept_peaks, kept_where), short_before = estimates()
    bsh = B * S * s.hidden * 2
    assert bsh == 2 * 1024**3
    assert kept_where == moved_where and moved_where[0].startswith("backward pack"), moved_where
    assert kept_peaks[0] - moved_peaks[0] == bsh, (kept_peaks[0] - moved_peaks[0]) / 1024**3
    assert moved.host["stashed_activations"] - kept.host["stashed_activations"] == bsh
    assert moved.host["stashed_activations"] == 32 * bsh  # boundaries 0..31 of 32 packs
    assert short_now.host == short_before.host and short_now.devices == short_before.devices


# ---------------------------------------------------------------- on CUDA (skipped without a GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("family,cfg", [
    ("llama", dict(devices=["cuda:0"], pack_size=1, micro_batch_size=2, backward_micro_batch_size=2,
                   compile_blocks="off")),
    ("qwen2", dict(devices=["cuda:0"], pack_size=2, micro_batch_size=1, backward_micro_batch_size=2,
                   max_grad_norm=0.5)),
    ("llama", dict(devices=["cuda:0", "cuda:0"], pack_size=[1, 3], micro_batch_size=2,
                   backward_micro_batch_size=2, compile_blocks="off")),
], ids=["1dev_eager", "tied_compiled_clip", "2x_same_gpu"])
def test_cuda_training_matches_pytorch(family: str, cfg: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The side streams: the embedding's output copied down on ``stash_out``, pack 0's rows and the
    embedding's gradient rows read ahead on ``stash_in``; fp32 without TF32, plain PyTorch's
    tolerances."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    seen = _spy(monkeypatch)
    _train_and_compare(family, cfg)
    assert seen["inputs"] == [True] * STEPS and seen["grads"] == [True] * STEPS
    per_step = 1 + -(-BATCH // cfg["micro_batch_size"])
    assert len(seen["embed_rows"]) == STEPS * per_step
