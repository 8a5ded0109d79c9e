"""Compiled decoder blocks (``Config.compile_blocks``) keep training exact and really compile.

The CPU runs use the ``aot_eager`` backend: the same Dynamo capture and AOT-autograd split that
Inductor gets on CUDA (the parts that see tinypipe's parameter rebinding), without the C++
code generation that would cost minutes on a 2-core CI machine. tests/test_gpu.py runs Inductor.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._dynamo.utils import counters

import tinypipe
from test_equivalence import run_both


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_compiled_blocks_match_pytorch(family: str) -> None:
    cfg = dict(devices=["cpu", "cpu"], pack_size=[1, 3], micro_batch_size=2, backward_micro_batch_size=3,
               prefetch_window=2, max_grad_norm=0.5, compile_blocks="aot_eager")
    run_both(family, cfg)
    # the blocks ran compiled: graphs were captured, reused across the 4 layers and 2 devices
    # (batch 5 -> forward shapes 2,2,1 / backward 3,2, times grad modes) and never fell back
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 12, dict(counters["stats"])


def test_compile_setting_is_validated() -> None:
    with pytest.raises(tinypipe.ConfigError, match="compile_blocks"):
        tinypipe.Config(compile_blocks="")
    from model_zoo import make_model

    with pytest.raises(tinypipe.ConfigError, match="unknown torch.compile backend"):
        tinypipe.Engine(make_model("llama"), tinypipe.Config(compile_blocks="no-such-backend"))


def test_auto_is_eager_on_cpu() -> None:
    from tinypipe.models.compiled import resolve_backend

    assert resolve_backend("auto", any_cuda=False) is None
    assert resolve_backend("off", any_cuda=True) is None
    assert resolve_backend("aot_eager", any_cuda=False) == "aot_eager"


def test_a_backend_that_fails_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compilation failing on the user's machine costs speed, not the run: the step completes eager
    and matches an eager engine."""
    from torch._dynamo import register_backend

    from model_zoo import make_batch, make_model

    @register_backend(name="tinypipe_test_broken")
    def broken(gm, example_inputs):  # noqa: ANN001, ANN202 - a Dynamo backend's signature
        raise RuntimeError("no C compiler here")

    batch = make_batch(4, 8, seed=0)
    losses = []
    for backend in ("tinypipe_test_broken", "off"):
        engine = tinypipe.Engine(make_model("llama"), tinypipe.Config(pack_size=2, micro_batch_size=2,
                                                                      compile_blocks=backend))
        losses.append([engine.step(batch).loss for _ in range(2)])
        engine.close()
    assert losses[0] == losses[1]


def test_a_compiled_block_runs_while_another_thread_holds_the_fx_tracing_flag() -> None:
    """Inductor's lowering sets FX's process-global tracing flag; a block entered meanwhile from
    another device's lane thread raised "FX to symbolically trace a dynamo-optimized function"
    (H200, QLoRA on two device entries). Under tinypipe's settings it runs and gives the result."""
    import threading

    import torch.fx._symbolic_trace as fx_trace

    from tinypipe.models.compiled import compile_settings

    double = torch.compile(lambda x: x * 2 + 1, backend="eager")
    out: dict[str, object] = {}

    def call(name: str, settings: bool) -> None:
        try:
            with compile_settings("eager") if settings else contextlib.nullcontext():
                out[name] = double(torch.ones(3)).tolist()
        except RuntimeError as err:
            out[name] = str(err)

    call("warm", True)
    old = fx_trace._is_fx_tracing_flag
    fx_trace._is_fx_tracing_flag = True  # what the compiling thread's FX tracer does
    try:
        for name, settings in (("plain", False), ("tinypipe", True)):
            thread = threading.Thread(target=call, args=(name, settings))
            thread.start()
            thread.join()
    finally:
        fx_trace._is_fx_tracing_flag = old
    assert "symbolically trace" in str(out["plain"])  # the failure is real without the settings
    assert out["tinypipe"] == [3.0, 3.0, 3.0]
