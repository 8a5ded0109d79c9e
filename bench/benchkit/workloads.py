"""Named benchmark workloads (issue #5): model shapes and batches, built without downloads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers


@dataclass(frozen=True)
class Workload:
    name: str
    config: dict
    seq: int
    batch: int

    @property
    def tokens(self) -> int:
        return self.seq * self.batch


WORKLOADS = {
    # Llama-3.2-3B shape: 3.21 B params, tied embeddings
    "W1": Workload("W1", dict(hidden_size=3072, num_hidden_layers=28, intermediate_size=8192,
                              num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
                              tie_word_embeddings=True, max_position_embeddings=8192,
                              rope_theta=500000.0), seq=2048, batch=16),
    # Llama-2-7B shape: 6.74 B params, untied
    "W3": Workload("W3", dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008,
                              num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                              tie_word_embeddings=False, max_position_embeddings=4096), seq=2048, batch=16),
    # small, for smoke tests of the benchmark itself (CPU or GPU)
    "tiny": Workload("tiny", dict(hidden_size=256, num_hidden_layers=4, intermediate_size=688,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                                  tie_word_embeddings=True, max_position_embeddings=512), seq=128, batch=8),
}


def build_model(w: Workload, seed: int = 0) -> torch.nn.Module:
    """Random-init LlamaForCausalLM (sdpa), fp32, filled fast from a tiled random pool."""
    cfg = transformers.LlamaConfig(**w.config)
    cfg._attn_implementation = "sdpa"
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older 5.x layouts
        from transformers.modeling_utils import no_init_weights  # type: ignore[no-redef]
    with no_init_weights():
        model = transformers.LlamaForCausalLM(cfg)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(1 << 24, generator=g) * 0.02
    shift = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.view(-1)
            if "norm" in name:
                flat.fill_(1.0)
                continue
            for lo in range(0, flat.numel(), pool.numel()):
                n = min(pool.numel(), flat.numel() - lo)
                start = shift % (pool.numel() - n + 1)
                flat[lo : lo + n].copy_(pool[start : start + n])
                shift += 7919
    model.eval()
    return model


def make_batch(w: Workload, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(w.config["vocab_size"]), (w.batch, w.seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
