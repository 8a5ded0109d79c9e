"""A tiny real tokenizer built in memory, so data tests need no download."""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

ROLE_TOKENS = ["<|system|>", "<|developer|>", "<|user|>", "<|assistant|>", "<|tool|>"]
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|end|>", *ROLE_TOKENS]

# Each turn is "<|role|>content<|end|>"; the generation prompt is "<|assistant|>".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Renders the final message differently from earlier ones, so prefix renderings
# are not prefixes of the full rendering: exercises the verbatim-content fallback.
LAST_TURN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if loop.last %}</s>{% else %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# A template that rejects conversations not starting with a user turn.
STRICT_TEMPLATE = (
    "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    + CHAT_TEMPLATE
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, how are you today? I am fine, thank you.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
]


@lru_cache(maxsize=None)
def make_tokenizer(add_bos: bool = True, chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any Unicode text round-trips), BOS added like Llama's."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    if add_bos:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|end|>", *ROLE_TOKENS],
    )
    if chat_template is not None:
        hf.chat_template = chat_template
    return hf


def write_jsonl(path: Path, records: Iterable[Any]) -> Path:
    """Write records (dicts are JSON-encoded, strings written verbatim) one per line."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def tiny_llama_and_corpus(tmp_path: Path) -> tuple[Path, Path]:
    """A saved 2-layer Llama with this tokenizer (``tmp_path/base``) and 40 corpus rows as
    ``tmp_path/train.jsonl``: what the ``finetune`` command tests train on."""
    import torch
    import transformers

    tok = make_tokenizer()
    model_dir = tmp_path / "base"
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    return model_dir, data
