"""The engine with sequence-chunked MLPs (``Config.mlp_chunk_tokens``, issue #32) trains exactly as
plain PyTorch and as the unchunked engine (fp32, several steps): Llama, Qwen2, Qwen3 and Mistral
with a sliding window shorter than the sequence, packed documents whose position ids restart,
recomputed and kept packs, compiled blocks, LoRA and QLoRA adapters inside the MLP. A micro-batch
that fits one chunk computes bit for bit what the unchunked engine does, and the automatic choice
leaves short sequences unchunked. A sabotaged chunking (its last chunk dropped) fails the same
tolerances, so they are tight enough to see a wrong implementation."""

from __future__ import annotations

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from reference import compare, randomize_biases, train_both
from tinypipe.models.chunked_mlp import ChunkedMLP, mlp_chunk_tokens_for
from tinypipe.train.data import pack

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LR, EPS, WD = 1e-3, 1e-6, 0.1
BATCH, SEQ, STEPS = 5, 16, 3
CHUNK = 5  # tokens per MLP chunk: uneven against every micro-batch below (2 x 16, 3 x 16 ...)


def _packed_batches() -> list[dict[str, torch.Tensor]]:
    """Rows of several documents each (position ids restarting inside a row)."""
    from test_packing import random_docs

    out = []
    for i in range(STEPS):
        ds, _ = pack(random_docs(12, seed=20 + i, longest=12), SEQ)
        assert ds.position_ids is not None and int((ds.position_ids[:BATCH] == 0).sum()) > BATCH
        out.append(ds.row_batch(slice(0, BATCH)))
    return out


def _batches(packed: bool) -> list[dict[str, torch.Tensor]]:
    if packed:
        return _packed_batches()
    return [make_batch(BATCH, SEQ, seed=i, pad=i == 1) for i in range(STEPS)]


def _chunked(engine: tinypipe.Engine) -> int:
    """How many blocks of the engine's device shells run a chunked MLP."""
    return sum(isinstance(getattr(b, "mlp", None), ChunkedMLP)
               for d in engine.devices for b in d.shell.blocks)


CONFIGS = {
    # recomputed packs, backward micro-batches larger than the forward's
    "recompute_packs2": dict(devices=["cpu"], pack_size=2, micro_batch_size=2, backward_micro_batch_size=3),
    # kept packs (compact graphs) beside recomputed ones, host stash, clipping
    "kept_host_stash_clip": dict(devices=["cpu"], pack_size=1, micro_batch_size=2, stash="host",
                                 keep_activations=[False, True, True, False], max_grad_norm=0.5),
    # two devices, compiled blocks (Dynamo traces the chunk loop and its checkpoints)
    "two_devices_compiled": dict(devices=["cpu", "cpu"], pack_size=[1, 3], micro_batch_size=2,
                                 backward_micro_batch_size=3, compile_blocks="aot_eager"),
}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed_docs"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_engine_matches_pytorch(family: str, name: str, packed: bool) -> None:
    """Losses and gradient norms of every step within 1e-5, final weights within 1e-5 per tensor
    and the update within 1e-4 of plain PyTorch (mistral: sliding window 8 < 16 tokens)."""
    torch._dynamo.reset()
    model = make_model(family)
    if family == "mistral":
        assert model.config.sliding_window < SEQ
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = dict(CONFIGS[name], mlp_chunk_tokens=CHUNK)
    engine, ref = train_both(model, model, _batches(packed), cfg, lr=LR, eps=EPS, weight_decay=WD)
    assert engine.mlp_chunk == CHUNK and _chunked(engine) == 4 * len(engine.devices)
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    engine.close()
    torch._dynamo.reset()


def _train(cfg: dict, batches: list[dict], family: str = "llama") -> tuple[list[float], dict]:
    model = make_model(family)
    randomize_biases(model)
    engine = tinypipe.Engine(model, tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD, head_chunk_tokens=7,
                                                    **cfg))
    losses = [engine.step(b).loss for b in batches]
    state = engine.state_dict()
    engine.close()
    return losses, state


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_chunked_engine_matches_the_unchunked_engine(family: str) -> None:
    """Same plan, MLP chunked (5 tokens) or not: losses within 1e-6 and weights within 1e-6
    relative per tensor after three steps (float rounding of matmuls over fewer rows)."""
    cfg = dict(devices=["cpu"], pack_size=2, micro_batch_size=2, backward_micro_batch_size=3)
    batches = _packed_batches()
    plain_losses, plain = _train(dict(cfg, mlp_chunk_tokens=0), batches, family)
    chunked_losses, chunked = _train(dict(cfg, mlp_chunk_tokens=CHUNK), batches, family)
    for a, b in zip(plain_losses, chunked_losses):
        assert abs(a - b) <= 1e-6 * abs(a), (a, b)
    for k, v in plain.items():
        assert float((chunked[k] - v).norm()) <= 1e-6 * float(v.norm()), k


def test_a_micro_batch_within_one_chunk_is_bit_identical() -> None:
    """Chunk 64 tokens >= every micro-batch (at most 4 x 16), kept and recomputed packs: every loss
    and weight equal to the unchunked engine's bit for bit; and the automatic choice leaves short
    sequences unchunked."""
    cfg = dict(devices=["cpu"], pack_size=2, micro_batch_size=2, backward_micro_batch_size=4,
               keep_activations=[True, False])
    batches = _batches(packed=False)
    plain_losses, plain = _train(dict(cfg, mlp_chunk_tokens=0), batches)
    one_losses, one = _train(dict(cfg, mlp_chunk_tokens=4 * SEQ), batches)
    assert plain_losses == one_losses
    assert all(torch.equal(plain[k], one[k]) for k in plain)
    auto = tinypipe.Engine(make_model("llama"), tinypipe.Config(seq_len=SEQ, global_batch=BATCH))
    assert auto.mlp_chunk == 0 and _chunked(auto) == 0
    auto.close()


def test_automatic_chunk_choice() -> None:
    """Off up to 16K tokens per sequence (or unknown), then a power of two bounding one
    intermediate near 256 MiB: 8192 tokens for the Llama-3.1-8B shape in bf16, 16384 for the 3B."""
    assert mlp_chunk_tokens_for(None, 14336, 2, None) == 0
    assert mlp_chunk_tokens_for(None, 14336, 2, 16384) == 0
    assert mlp_chunk_tokens_for(None, 14336, 2, 65536) == 8192
    assert mlp_chunk_tokens_for(None, 8192, 2, 131072) == 16384
    assert mlp_chunk_tokens_for(None, 1 << 20, 4, 131072) == 1024  # never below 1024 tokens
    assert mlp_chunk_tokens_for(0, 14336, 2, 131072) == 0
    assert mlp_chunk_tokens_for(4096, 14336, 2, 2048) == 4096
    with pytest.raises(tinypipe.ConfigError, match="mlp_chunk_tokens"):
        tinypipe.Config(mlp_chunk_tokens=-1)


def test_lora_inside_a_chunked_mlp_matches_peft() -> None:
    """PEFT adapters on every projection (the MLP's too), chunked: adapters as PEFT + AdamW train
    them; the frozen base never moves."""
    from test_lora import lora_model, trainable

    pm = lora_model("llama")
    inner = pm.base_model.model
    init = {k: v.clone() for k, v in inner.state_dict().items()}
    cfg = dict(devices=["cpu"], pack_size=2, micro_batch_size=2, backward_micro_batch_size=3,
               mlp_chunk_tokens=CHUNK)
    engine, ref = train_both(pm, inner, _batches(packed=True), cfg, lr=LR, eps=EPS, weight_decay=WD)
    assert _chunked(engine) == 4
    state = engine.state_dict()
    adapters = trainable(state, ref.model)
    assert any(".mlp." in k for k in adapters)
    ref_sd = ref.model.state_dict()
    for k in adapters:
        assert float((state[k] - ref_sd[k]).norm()) <= 1e-5 * float(ref_sd[k].norm()), k
    assert all(torch.equal(v, init[k]) for k, v in state.items() if k not in adapters)
    engine.close()


def test_qlora_chunked_equals_unchunked() -> None:
    """An nf4 base (bitsandbytes on CPU) with adapters inside the MLP: the chunked engine's losses
    and adapters equal the unchunked engine's to float rounding."""
    pytest.importorskip("bitsandbytes")
    from test_qlora import qlora_model
    from tinypipe.quant.spec import QuantSpec

    spec = QuantSpec("nf4", double_quant=True, compute_dtype=torch.float32)
    runs = []
    for chunk in (0, CHUNK):
        torch.manual_seed(0)
        pm = qlora_model("llama", spec)
        engine = tinypipe.Engine(pm, tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD, head_chunk_tokens=7,
                                                     devices=["cpu"], pack_size=2, micro_batch_size=2,
                                                     mlp_chunk_tokens=chunk, precision="fp32"))
        assert _chunked(engine) == (4 if chunk else 0)
        losses = [engine.step(b).loss for b in _batches(packed=True)]
        state = {k: v for k, v in engine.state_dict().items() if ".lora_" in k}
        runs.append((losses, state))
        engine.close()
    (la, sa), (lb, sb) = runs
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(la, lb)), (la, lb)
    assert sa and all(float((sb[k] - v).norm()) <= 1e-5 * float(v.norm()) for k, v in sa.items())


def test_a_wrong_chunking_fails_these_tolerances(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the last (partial) chunk's rows left at zero. The comparison with PyTorch must fail."""
    real = ChunkedMLP.forward

    def drops_the_tail(self: ChunkedMLP, hidden: torch.Tensor) -> torch.Tensor:
        out = real(self, hidden)
        tokens = hidden[..., 0].numel()
        if tokens <= self.chunk_tokens:
            return out
        flat = out.reshape(tokens, -1)
        keep = torch.ones(tokens, 1, dtype=out.dtype)
        keep[tokens - tokens % self.chunk_tokens or tokens - self.chunk_tokens:] = 0
        return (flat * keep).reshape(out.shape)

    monkeypatch.setattr(ChunkedMLP, "forward", drops_the_tail)
    model = make_model("llama")
    with pytest.raises(AssertionError):
        train_both(model, model, _batches(packed=False),
                   dict(CONFIGS["recompute_packs2"], mlp_chunk_tokens=CHUNK), lr=LR, eps=EPS, weight_decay=WD)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_folded_norms_shrink_what_a_chunked_block_saves(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's probe (bf16, hidden 512): a recomputed block with its MLP chunked saves per
    token ~21 x hidden bytes (Llama; Qwen3's per-head norms ~29) with its norms in place, at most
    8 x hidden with them folded into the chunks (q', k', v, the attention output and o_proj's
    input: 7 x hidden for this GQA shape)."""
    import transformers

    from tinypipe.models import chunked_mlp
    from tinypipe.planner import probe

    make = transformers.Qwen3Config if family == "qwen3" else transformers.LlamaConfig
    cfg = make(hidden_size=512, intermediate_size=1792, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=2, head_dim=64, vocab_size=1000)
    cfg._attn_implementation = "sdpa"
    h = cfg.hidden_size
    _, _, folded = probe._saved_bytes_per_token(cfg, torch.bfloat16)
    monkeypatch.setattr(chunked_mlp, "FOLDABLE", frozenset())
    _, _, unfolded = probe._saved_bytes_per_token(cfg, torch.bfloat16)
    assert folded <= 8 * h and unfolded >= 20 * h, (folded / h, unfolded / h)
