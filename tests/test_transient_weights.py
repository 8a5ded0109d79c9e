"""Transient frozen embedding/head weights at long sequences (schedule/transient_grads.py, issue #32):
which layers qualify; LoRA trained with the two weight buffers allocated by their upload and freed
after their last reader gives the same losses, norms and adapters, bit for bit, as with them
resident, and the pool holds neither after a step; the planner's estimate moves them out of the
static bytes into their phases; the 8B QLoRA 256K row gains their 2 GiB."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tinypipe
import tinypipe.runtime.build as runtime_build
from model_zoo import make_batch, make_model
from reference import randomize_biases
from tinypipe.lora import LoraSettings, apply_lora
from tinypipe.schedule.plan import Plan
from tinypipe.schedule.transient_grads import transient_weight_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PLAN = Plan(packs=((0, 1), (2, 3)), micro_batch_size=2, backward_micro_batch_size=3, fwd_device=(0, 0),
            bwd_device=(0, 0), stash_on_host=(False, False, False))
HEAD = PLAN.num_blocks + 1
BOTH = frozenset({0, HEAD})


def test_which_weights_are_transient() -> None:
    """Frozen ones only, at long sequences only, never under a tied head or a turn."""
    assert transient_weight_layers(PLAN, False, BOTH, long_sequences=True) == BOTH
    assert transient_weight_layers(PLAN, False, BOTH, long_sequences=False) == frozenset()
    assert transient_weight_layers(PLAN, False, frozenset({HEAD}), True) == {HEAD}  # a trained embedding
    assert transient_weight_layers(PLAN, False, frozenset(), True) == frozenset()  # full fine-tuning
    assert transient_weight_layers(PLAN, True, BOTH, True) == frozenset()
    turn = dataclasses.replace(PLAN, backward_micro_batch_size=2, turn_packs=1, keep_activations=(False, True))
    assert transient_weight_layers(turn, False, BOTH, True) == frozenset()


def _engine(transient: bool, monkeypatch: pytest.MonkeyPatch, device: str = "cpu",
            **over: object) -> tinypipe.Engine:
    if not transient:  # the same long-sequence engine, the weights resident
        monkeypatch.setattr(runtime_build, "transient_weight_layers", lambda *a, **k: frozenset())
    torch.manual_seed(0)
    base = make_model("llama")
    randomize_biases(base)
    model = apply_lora(base, LoraSettings(rank=4, alpha=8.0))
    cfg = dict(devices=[device], pack_size=2, micro_batch_size=2, backward_micro_batch_size=3,
               mlp_chunk_tokens=5, lr=1e-3, eps=1e-6, weight_decay=0.1, head_chunk_tokens=7)
    cfg.update(over)
    engine = tinypipe.Engine(model, tinypipe.Config(**cfg))
    monkeypatch.undo()
    return engine


def _train_both(monkeypatch: pytest.MonkeyPatch, device: str = "cpu", **over: object) -> None:
    batches = [make_batch(5, 16, seed=i, pad=i == 1) for i in range(3)]
    held = _engine(False, monkeypatch, device, **over)
    free = _engine(True, monkeypatch, device, **over)
    head = held.plan.num_blocks + 1
    pool = free.devices[0].pool
    assert pool.transient_weights == {0, head} and not held.devices[0].pool.transient_weights
    for b in batches:
        r1, r2 = held.step(b), free.step(b)
        assert (r1.loss, r1.grad_norm) == (r2.loss, r2.grad_norm)
        assert not {0, head} & set(pool.resident), "a transient weight outlived its last reader"
    s1, s2 = held.state_dict(), free.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    layers = free.decomposition.layers
    freed = pool.dtype.itemsize * (layers[0].numel + layers[head].numel)
    resident = [e.devices[0].pool.bytes_by_category()["resident_layers"] for e in (held, free)]
    assert resident[0] - resident[1] == freed > 0
    held.close()
    free.close()


@pytest.mark.parametrize("over", [{}, {"max_grad_norm": 0.05}], ids=["plain", "clipped"])
def test_transient_weights_train_lora_bit_identically(over: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three LoRA steps: the same losses, norms and adapter weights, bit for bit; neither weight
    in the pool after a step (an engine that kept them fails here)."""
    _train_both(monkeypatch, **over)


def test_evaluation_between_steps_uploads_them_again(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(True, monkeypatch)
    batch = make_batch(5, 16, seed=0)
    first = engine.evaluate(batch).loss
    engine.step(batch)
    engine.step(batch)
    assert engine.evaluate(batch).loss != first  # trained, and evaluated on the weights it holds
    engine.close()


def test_the_estimate_moves_the_weights_into_their_phases() -> None:
    """Static bytes lose both frozen weights at long sequences; the activation peak (in the block
    backward) does not gain them back; the 8B QLoRA row of one 256K sequence plans 2 GiB lower."""
    import sys
    from pathlib import Path

    from tinypipe.planner import estimate

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import long_context as lc

    # one tile for both (the planner would otherwise spend the freed 2 GiB on a larger tile)
    a = lc.parse(["--rows", "8b-qlora-256k-b1", "--cpu-gib", "128", "--plan-only",
                  "--attention-tile-tokens", "8192"])
    row = lc.ROWS["8b-qlora-256k-b1"]
    now = lc.plan_row(row, 256 * 1024, a)
    real = estimate.transient_weights
    try:
        estimate.transient_weights = lambda *args, **kw: frozenset()  # type: ignore[assignment]
        before = lc.plan_row(row, 256 * 1024, a)
    finally:
        estimate.transient_weights = real  # type: ignore[assignment]
    assert now["fits"] and before["fits"]
    weights = 2 * 128256 * 4096 * 2  # the 8B shape's embedding and head, bf16
    assert weights * 0.99 <= before["gpu_need"] - now["gpu_need"] <= weights * 1.2
    assert now["gpu_need"] <= 22 * lc.GiB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_transient_weights_train_lora_bit_identically(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (the weights uploaded on one stream, read on another, freed to the caching
    allocator): the same training, bit for bit, and neither weight held after a step."""
    _train_both(monkeypatch, "cuda:0", precision="bf16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_freed_weights_go_back_to_the_compute_streams_pool() -> None:
    """The caching allocator reuses a freed block only for allocations on the stream it was made
    on. The transient weights come from the compute stream's pool, so the activations after their
    release reuse them: no free block of their size is left in a segment of the upload stream
    (allocated there, the 8B shape's 2 GiB stayed reserved and unused: a 64K QLoRA row's reserved
    peak 2 GiB above its allocated one, bench/results/acceptance/cee9907aabd5)."""
    import transformers

    torch.manual_seed(0)
    vocab, hidden = 32000, 256
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = apply_lora(transformers.LlamaForCausalLM(cfg), LoraSettings(rank=4, alpha=8.0))
    engine = tinypipe.Engine(model, tinypipe.Config(devices=["cuda:0"], pack_size=1, micro_batch_size=2,
                                                    precision="bf16", mlp_chunk_tokens=8, head_chunk_tokens=8,
                                                    lr=1e-3))
    dev = engine.devices[0]
    assert dev.pool.transient_weights == {0, engine.plan.num_blocks + 1}
    batch = {"input_ids": torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))}
    for _ in range(2):
        engine.step(batch)
    torch.cuda.synchronize()
    h2d = dev.streams["h2d"].cuda_stream
    weight = vocab * hidden * 2
    stranded = [b["size"] for seg in torch.cuda.memory_snapshot() if seg["stream"] == h2d
                for b in seg["blocks"] if b["state"] == "inactive" and b["size"] >= weight]
    assert not stranded, f"free blocks of the upload stream's pool: {stranded}"
    engine.close()
