"""Compiled decoder blocks: torch.compile fuses the elementwise work HF's eager blocks leave unfused.

Measured on an H200 (Llama-3.2-3B block, 4 x 2048 tokens, bf16; ``bench/block_profile.py``):
eager forward 3.73 ms / recompute+backward 11.33 ms, compiled 2.62 / 8.75 ms -- RMSNorm in fp32,
rotary embeddings and SiLU*up are a quarter of an eager block's time. The matmuls alone take
2.14 / 6.34 ms, so compiled blocks run close to the GEMM ceiling.

Every block of a model shares one forward code object, and the shell rebinds parameters as
plain tensors, so Dynamo guards on tensor metadata only: one graph per (grad mode, micro-batch
shape, layer kind), reused by all layers and all devices. Shapes are compiled statically
(``dynamic=False``): a step has at most a handful of micro-batch shapes, and static kernels are
faster than symbolic ones.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any, Callable

import torch
from torch import nn

# Graphs per block code object: grad mode x forward/backward/tail micro-batch shapes x layer kinds
# (e.g. Qwen2's sliding-window layers). Above it Dynamo would silently fall back to eager.
RECOMPILE_LIMIT = 64


def resolve_backend(setting: str, any_cuda: bool) -> str | None:
    """The torch.compile backend for ``Config.compile_blocks`` (None: run eager).

    ``"auto"`` compiles with Inductor on CUDA when Triton is installed and runs eager on CPU,
    where Inductor's C++ compile costs more than it saves on short test runs.
    """
    if setting == "off":
        return None
    if setting == "auto":
        if not any_cuda or importlib.util.find_spec("triton") is None:
            return None
        return "inductor"
    return setting


def compile_settings(backend: str | None, replay_random: bool = False) -> contextlib.ExitStack:
    """Dynamo/Inductor settings for compiling tinypipe's blocks (thread-local: enter them in the
    thread that calls the block). ``replay_random``: random ops (dropout) run eager's kernels."""
    stack = contextlib.ExitStack()
    if backend is None:
        return stack
    cfg = torch._dynamo.config
    key = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # older torch
    # a machine where compiling fails (no C compiler for Triton's launcher, a broken Triton) runs
    # the blocks eager, with Dynamo's warning, instead of failing the step
    stack.enter_context(cfg.patch(**{key: RECOMPILE_LIMIT, "suppress_errors": True}))
    # Inductor's lowering runs an FX tracer (loop_body.py) that sets a process-global "FX is
    # tracing" flag; a compiled block entered meanwhile from another lane thread (a second device
    # entry) saw the flag and raised "Detected that you are using FX to symbolically trace a
    # dynamo-optimized function" (two device entries on one GPU, docs/measured.md). Such a
    # thread is not inside any trace: let it run its compiled graph
    if hasattr(cfg, "force_compile_during_fx_trace"):
        stack.enter_context(cfg.patch(force_compile_during_fx_trace=True))
    else:  # older torch: run that one call eager instead of failing it
        stack.enter_context(cfg.patch(error_on_nested_fx_trace=False))
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        # compile in-process: Inductor's default pool of one worker process per core (each
        # importing torch) added 6.7 GB to peak host RSS on a 16-core box -- host memory is what
        # tinypipe users are short of; the one-off compile takes longer instead
        stack.enter_context(inductor_config.patch(compile_threads=1))
        if replay_random:
            # Inductor's own random ops seed a philox stream from the device generator at graph
            # entry (torch.randint), reproducible but not eager's numbers; fallback_random runs
            # eager's dropout kernels in program order, so a compiled block draws exactly what an
            # eager one does from the state tinypipe sets (runtime/rng.py) -- no-grad forward and
            # grad recompute alike. Only graphs with random ops change (measured on CPU Inductor:
            # F.dropout equal to eager with it, not without; SDPA's dropout on CPU is decomposed
            # differently either way, equal between the two graphs -- tests/test_dropout.py)
            stack.enter_context(inductor_config.patch(fallback_random=True))
    functorch_config = torch._functorch.config
    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        # compile the backward graph now, in this thread: lowered lazily it compiles inside
        # autograd's device thread, which none of these thread-local settings reach (measured on
        # an H200: 17 Inductor worker processes, +6.9 GB host RSS, in a run with a warm cache)
        stack.enter_context(functorch_config.patch(force_non_lazy_backward_lowering=True))
    return stack


class CompiledBlock:
    """Calls a block through torch.compile, with a recompile limit that fits tinypipe's shapes."""

    def __init__(self, block: nn.Module, backend: str, replay_random: bool = False) -> None:
        self.block = block
        self.backend = backend
        self.replay_random = replay_random
        # resolving the backend may start Inductor's worker pool
        with compile_settings(backend, replay_random):
            self.compiled: Callable[..., Any] = torch.compile(block, backend=backend, dynamic=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # per call, in the calling thread: Dynamo's and Inductor's config patches are thread-local,
        # and the blocks run (and compile) in the engine's lane threads
        with compile_settings(self.backend, self.replay_random):
            return self.compiled(*args, **kwargs)
