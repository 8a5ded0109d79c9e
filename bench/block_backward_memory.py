#!/usr/bin/env python3
"""One decoder block's backward memory at long sequences, measured against the planner's terms.

The planner sizes a token-chunked block's backward (long sequences, issue #32) as the saved set
of its recompute plus one MLP chunk's 2 x intermediate (``planner/estimate.py``); the 2 x 64K
QLoRA acceptance row peaked 2.35 GiB above that estimate on an H100 (docs/long_context.md). This
runs one real-width block as the engine runs a backward task -- the block input and the output
gradient on the device, the recompute under autograd, then ``torch.autograd.grad`` on the input
and the trainable parameters -- through tinypipe's own shell (chunked MLP, folded norms, segment
attention, compiled blocks as ``Config.compile_blocks="auto"`` would), and reports per sequence
length: what the recompute saved, and what the backward allocated above its start, each next to
the planner's figure, in GiB and in [S, H] tensors of the compute dtype.

    python bench/block_backward_memory.py --seq 16384 --seq 65536              # on the GPU machine
    python bench/block_backward_memory.py --train lora --seq 16384 --seq 65536

``--train lora`` needs peft: on the GPU machine carry the wheels (``.whl/``, see
``bench/acceptance_device.sh``) and run ``python3 -m pip install -q --no-index --no-deps --target
/tmp/site .whl/*.whl && PYTHONPATH=$PWD:/tmp/site python3 bench/block_backward_memory.py ...``.
    python bench/block_backward_memory.py --device cpu --model tiny --seq 1024 --chunk 256   # smoke

On CUDA the numbers come from ``torch.cuda.max_memory_allocated``; on the CPU from the profiler's
allocation timeline (a proxy: the CPU's attention kernels allocate differently). Prints a table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from tinypipe.models.chunked_mlp import mlp_chunk_tokens_for  # noqa: E402

GIB = 1024**3


def cpu_peak(fn: Callable[[], object]) -> int:
    """Peak of bytes allocated minus freed while ``fn`` runs (profiler allocation timeline)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler import _memory_profiler as mp

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        fn()
    cur = peak = 0
    for _, action, _, size in mp.MemoryProfile(prof.profiler.kineto_results).timeline:
        cur += size if action == mp.Action.CREATE else -size if action == mp.Action.DESTROY else 0
        peak = max(peak, cur)
    return peak


def chunked_block(cfg, dtype: torch.dtype, lora, chunk: int, dev: torch.device, *,  # noqa: ANN001
                  segment_attention: bool = False, backend: str | None = None) -> tuple[object, list[torch.Tensor]]:
    """A shell of ``cfg``'s probe-initialised model (``lora``: with adapters) on ``dev``, its MLPs in
    chunks of ``chunk`` tokens, its parameters bound; and block 0's trainable tensors as bound."""
    from tinypipe.models.decompose import Decomposition
    from tinypipe.models.shell import Shell
    from tinypipe.planner.probe import probe_model

    model = probe_model(cfg, dtype, lora)
    dec = Decomposition(model)
    shell = Shell(model, dec, dev, mlp_chunk_tokens=chunk, segment_attention=segment_attention)
    if backend is not None:
        shell.compile_blocks(backend)
    named = dict(model.named_parameters())
    for name in dec.aliases:
        shell.bind(name, named[name].detach().to(dev).requires_grad_(named[name].requires_grad))
    trained = []
    for p in dec.layers[1].params:
        module, attr = shell._slots[p.name][0]  # noqa: SLF001 - a measurement script
        if module._parameters[attr].requires_grad:  # noqa: SLF001
            trained.append(module._parameters[attr])  # noqa: SLF001
    return shell, trained


def _measure(dev: torch.device, fn: Callable[[], object]) -> tuple[object, int, int]:
    """(fn's result, bytes it left allocated, its peak above its start)."""
    if dev.type != "cuda":
        out: list[object] = []
        peak = cpu_peak(lambda: out.append(fn()))
        return out[0], -1, peak
    torch.cuda.synchronize(dev)
    start = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    result = fn()
    torch.cuda.synchronize(dev)
    return result, torch.cuda.memory_allocated(dev) - start, torch.cuda.max_memory_allocated(dev) - start


def _config(name: str):  # noqa: ANN202 - a transformers config
    import transformers

    from tinypipe.planner.presets import load_model_config
    from tinypipe.planner.probe import set_layers

    if name == "tiny":
        cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=896, num_attention_heads=8,
                                       num_key_value_heads=2, num_hidden_layers=2, vocab_size=128)
    else:
        cfg = load_model_config(name)
    cfg._attn_implementation = "sdpa"
    sizes_cfg = cfg
    one = type(cfg).from_dict(cfg.to_dict())
    one._attn_implementation = "sdpa"
    set_layers(one, 1)
    return sizes_cfg, one


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", help="a preset, model directory or config.json; 'tiny'")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--seq", type=int, action="append", help="tokens of the one sequence (repeatable)")
    ap.add_argument("--chunk", type=int, default=None, help="MLP chunk tokens (default: the planner's choice)")
    ap.add_argument("--train", choices=("full", "lora"), default="full",
                    help="full fine-tuning, or rank-16 adapters on a frozen dense base")
    ap.add_argument("--compile", default="auto", help="Config.compile_blocks: auto, off, inductor ...")
    a = ap.parse_args()

    from tinypipe.lora import LoraSettings
    from tinypipe.models.compiled import resolve_backend
    from tinypipe.planner.sizes import lora_sizes, model_sizes

    dev = torch.device(a.device)
    dtype = torch.bfloat16
    elem = 2
    sizes_cfg, cfg = _config(a.model)
    settings = LoraSettings(rank=16, alpha=32.0) if a.train == "lora" else None
    sizes = lora_sizes(sizes_cfg, settings) if settings is not None else model_sizes(sizes_cfg)
    backend = resolve_backend(a.compile, dev.type == "cuda")
    rows = []
    for seq in a.seq or [16384, 65536]:
        chunk = a.chunk if a.chunk is not None else mlp_chunk_tokens_for(None, sizes.intermediate, elem, seq)
        torch.manual_seed(0)
        shell, trained = chunked_block(cfg, dtype, settings, chunk, dev, segment_attention=True, backend=backend)
        ids = torch.randint(0, sizes.vocab, (1, seq), device=dev)
        with torch.no_grad():
            hidden, calls = shell.embed_forward(ids, None)
        x = hidden.detach().to(dtype).requires_grad_(True)
        del hidden
        gout = torch.randn_like(x)

        def recompute() -> torch.Tensor:
            with torch.enable_grad():
                return shell.block_forward(0, x, calls[0])

        for _ in range(2):  # the first compiles (and warms the allocator); the second is measured
            y, saved, _ = _measure(dev, recompute)
            _, _, bwd_peak = _measure(dev, lambda: torch.autograd.grad(y, [x, *trained], gout))
            del y
        u = seq * sizes.hidden * elem
        act, mlp = sizes.block_act_bytes("bf16"), sizes.mlp_bytes_per_token("bf16")
        rows_ = chunk if 0 < chunk < seq else seq
        plan_saved = seq * (act - mlp) + rows_ * mlp if rows_ < seq else seq * act
        plan_transient = rows_ * 2 * sizes.intermediate * elem
        rows.append((seq, chunk, saved, plan_saved, bwd_peak, plan_transient, u))
        print(f"seq {seq}: chunk {chunk}, saved {saved / GIB:.2f} GiB (planner {plan_saved / GIB:.2f}), "
              f"backward above its start {bwd_peak / GIB:.2f} GiB (planner {plan_transient / GIB:.2f})", flush=True)
        del x, gout, calls, shell, trained
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    print(f"\n{a.model}, {a.train}, bf16, compile {backend or 'off'}, {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}"
          "; u = one [S, H] tensor; saved -1: not measured on the CPU")
    print(f"{'seq':>7} {'chunk':>6} {'saved GiB':>9} {'plan':>6} {'bwd GiB':>8} {'plan':>6} {'saved u':>8} {'bwd u':>6}")
    for seq, chunk, saved, plan_saved, bwd, plan_tr, u in rows:
        print(f"{seq:>7} {chunk:>6} {saved / GIB:>9.2f} {plan_saved / GIB:>6.2f} {bwd / GIB:>8.2f} "
              f"{plan_tr / GIB:>6.2f} {saved / u:>8.2f} {bwd / u:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
