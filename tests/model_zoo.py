"""Tiny random-init models of every supported family (no downloads), for exactness tests."""

from __future__ import annotations

import torch
import transformers

VOCAB = 97


def _common(**kw: object) -> dict:
    return dict(vocab_size=VOCAB, **kw)


def _decoder(**kw: object) -> dict:
    """The Llama-like families' shared tiny shape (grouped-query attention)."""
    return _common(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=128, **kw)


def make_config(family: str, layers: int = 4, tied: bool | None = None) -> transformers.PretrainedConfig:
    """A small config of ``family``; ``tied`` overrides the family's default weight tying."""
    if family == "llama":
        cfg = transformers.LlamaConfig(**_decoder(num_hidden_layers=layers, tie_word_embeddings=False))
    elif family == "mistral":
        cfg = transformers.MistralConfig(**_decoder(num_hidden_layers=layers, sliding_window=8,
                                                    tie_word_embeddings=False))
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**_decoder(num_hidden_layers=layers, tie_word_embeddings=True))
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**_decoder(num_hidden_layers=layers, head_dim=8, tie_word_embeddings=True))
    elif family == "gpt2":
        cfg = transformers.GPT2Config(**_common(n_embd=32, n_layer=layers, n_head=4, n_positions=128,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                bos_token_id=0, eos_token_id=0))
    elif family == "opt":
        cfg = transformers.OPTConfig(**_common(hidden_size=32, ffn_dim=64, num_hidden_layers=layers,
                                               num_attention_heads=4, max_position_embeddings=128,
                                               word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                                               pad_token_id=1))
    else:
        raise ValueError(family)
    if tied is not None:
        cfg.tie_word_embeddings = tied
    cfg._attn_implementation = "sdpa"
    return cfg


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "opt")


def make_model(family: str, layers: int = 4, seed: int = 0, tied: bool | None = None) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(make_config(family, layers, tied), dtype=torch.float32)
    model.eval()
    return model


def make_batch(batch: int, seq: int, seed: int = 0, pad: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, seq), generator=g)
    out = {"input_ids": ids}
    if pad:
        mask = torch.ones(batch, seq, dtype=torch.long)
        for i in range(batch):
            cut = int(torch.randint(seq // 2, seq + 1, (1,), generator=g))
            mask[i, cut:] = 0
        out["attention_mask"] = mask
        labels = ids.clone()
        labels[mask == 0] = -100
        out["labels"] = labels
    return out
