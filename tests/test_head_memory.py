"""The chunked LM head's memory, measured on the CPU (issue #32): the host peak of one engine step
at a long sequence with a wide vocabulary, head in chunks of 256 tokens against one chunk of all
4096 (the unchunked head: fp32 logits for every token, 256 MiB). Measured, not estimated: the
kernel's resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) over
the step, less the resident set before it -- every allocation of every lane thread counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import tinypipe

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, SEQ = 16384, 4096
LOGITS = SEQ * VOCAB * 4  # one sequence's fp32 logits: 256 MiB


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _can_reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        _status("VmHWM:")
        return True
    except (OSError, KeyError):
        return False


def _step_peak(head_chunk: int) -> tuple[int, float]:
    """(host bytes one step adds at its peak, its loss) -- after a first step that allocated the
    engine's lazily built buffers."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                   max_position_embeddings=SEQ,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    engine = tinypipe.Engine(model, tinypipe.Config(pack_size=1, micro_batch_size=1, lr=0.0,
                                                    head_chunk_tokens=head_chunk, compile_blocks="off"))
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    engine.step({"input_ids": ids})
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS:")
    loss = engine.step({"input_ids": ids}).loss
    peak = _status("VmHWM:") - before
    engine.close()
    return peak, loss


@pytest.mark.skipif(not _can_reset_peak(), reason="needs Linux's /proc/self/clear_refs to reset VmHWM")
def test_chunked_head_peak_is_a_chunk_not_the_logits() -> None:
    chunked, loss_chunked = _step_peak(256)
    whole, loss_whole = _step_peak(SEQ)
    assert whole >= LOGITS, (whole / 2**20, "MiB: the unchunked head holds every token's logits")
    assert chunked <= LOGITS / 8, (chunked / 2**20, "MiB")  # measured ~8-14 MiB: 16 MiB of logits per chunk
    assert abs(loss_chunked - loss_whole) <= 1e-6 * abs(loss_whole)  # lr 0: the same weights both steps
