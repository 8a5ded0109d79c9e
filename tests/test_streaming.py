"""Gradient downloads stream through a bounded host pool: layers larger than the pool's chunks,
and a pool of a single buffer, must neither deadlock nor change the result."""

from __future__ import annotations

import torch
import transformers

import tinypipe
from model_zoo import make_batch
from reference import compare, train_reference


def big_vocab_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=5000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_embedding_larger_than_pool_chunks_with_one_buffer() -> None:
    model = big_vocab_llama()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [make_batch(3, 10, seed=i) for i in range(2)]
    ref = train_reference(model, batches, lr=1e-3, eps=1e-6, weight_decay=0.0)
    cfg = tinypipe.Config(devices=["cpu"], lr=1e-3, eps=1e-6, host_grad_buffers=1, stall_timeout_s=60)
    engine = tinypipe.Engine(model, cfg)
    assert engine.store.layers[0].spec.numel > engine.devices[0].grad_pool.chunk  # streamed in chunks
    for b in batches:
        engine.step(b)
    worst, update = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update <= 1e-4
