"""What one chunked block's backward allocates above what is alive when it starts, on a probe model
(CPU, eager, bf16), from the profiler's allocation timeline -- for the planner's long-context
backward phase (issue #32), which counts the saved set plus one MLP chunk's 2 x intermediate.

Per probe scale (widths / s of the Llama-3.1-8B shape), three runs separate the three terms of
``extra(T, c) = T * g + c * m + K``: g per token (the gradients in flight), m per MLP-chunk token
(a chunk's recomputed intermediates and their gradients), K the rest (the block's parameter
gradients, their accumulation over chunks).

Caveat (2026-12-07): the CPU's attention backward is not the GPU's. On one sequence of 1,024 tokens
(hidden 256) the CPU backward allocates 6.8 KB per token more than at 512 (its SDPA kernel blocks
differently), where the probes' 16-32 tokens gave 4 x H bytes; the GPU's flash backward keeps an fp32
dq accumulator instead. So these figures do not set the GPU estimate by themselves: a per-block
backward peak measured on the GPU at long sequences is what the estimate needs (docs/long_context.md).

    python bench/archive/block_backward_probe.py --scale 32 --scale 16 [--lora]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # block_backward_memory


def backward_extra(cfg, seq: int, chunk: int, lora) -> tuple[int, int]:  # noqa: ANN001
    """(what block 0's backward allocates above its start, its trainable parameters' bytes)."""
    import torch

    from block_backward_memory import chunked_block, cpu_peak
    from tinypipe.planner.probe import PROBE_VOCAB

    shell, trained = chunked_block(cfg, torch.bfloat16, lora, chunk, torch.device("cpu"))
    ids = torch.randint(0, PROBE_VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden, calls = shell.embed_forward(ids, None)
    x = hidden.detach().requires_grad_(True)
    with torch.enable_grad():
        y = shell.block_forward(0, x, calls[0])
    gy = torch.randn_like(y)
    extra = cpu_peak(lambda: torch.autograd.grad(y, [x, *trained], gy, allow_unused=True))
    return extra, sum(t.numel() * t.element_size() for t in trained)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, action="append", default=None)
    ap.add_argument("--lora", action="store_true", help="rank-16 adapters on every projection")
    a = ap.parse_args()
    import transformers

    from tinypipe.lora import LoraSettings
    from tinypipe.planner.probe import probe_config

    cfg = transformers.AutoConfig.for_model("llama", hidden_size=4096, intermediate_size=14336,
                                            num_attention_heads=32, num_key_value_heads=8,
                                            num_hidden_layers=32, vocab_size=128256)
    cfg._attn_implementation = "sdpa"
    lora = LoraSettings(rank=16, alpha=32.0) if a.lora else None
    for scale in a.scale or [32, 16]:
        pc = probe_config(cfg, scale, layers=1)
        (e1, pg), (e2, _), (e3, _) = (backward_extra(pc, s, c, lora) for s, c in ((16, 8), (32, 8), (32, 16)))
        g = (e2 - e1) / 32
        m = (e3 - e2) / 8
        k = e1 - 32 * g - 8 * m
        H, inter = pc.hidden_size, pc.intermediate_size
        print(f"scale {scale} (H {H}, I {inter}{', LoRA r16' if lora else ''}): extra(32, 8) {e1} B, "
              f"(64, 8) {e2}, (64, 16) {e3}; g {g:.0f} B/token = {g / H:.2f} x H, "
              f"m {m:.0f} B/chunk token = {m / inter:.2f} x I, K {k:.0f} B (parameter gradients {pg} B)")


if __name__ == "__main__":
    main()
