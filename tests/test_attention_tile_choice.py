"""The planner chooses the attention tile (issue #32): with ``Config.attention_tile_tokens`` unset it
weighs every tile of ``ATTENTION_TILE_OPTIONS`` shorter than a long row, keeps the fastest plan
that fits (a larger tile merges less, and holds more in the attention's backward), falls back to
smaller tiles where memory is short, refuses as the smallest tile does, and the engine's shells
run the tile the plan was sized and timed with. Short rows, other families and a fixed tile plan
exactly as before."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tinypipe
from model_zoo import make_model
from tinypipe.errors import PlanDoesNotFitError
from tinypipe.lora import LoraSettings
from tinypipe.models.segment_attention import TILE_ATTR
from tinypipe.models.tiled_attention import ATTENTION_TILE_OPTIONS, ATTENTION_TILE_TOKENS
from tinypipe.planner.estimate import attention_tile_options
from tinypipe.planner.presets import load_model_config
from tinypipe.planner.search import plan_for, ranking_seconds
from tinypipe.units import GIB

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QLORA = LoraSettings(rank=16, alpha=32.0, quantize="nf4", compute_dtype="bf16")


def _qlora_8b(seq: int, gpu_gib: float, tile: int | None = None, batch: int = 2):  # -> PlanResult
    return plan_for(load_model_config("llama-3.1-8b"), "h200-pcie5", gpus=1, gpu_memory_bytes=int(gpu_gib * GIB),
                    cpu_memory_bytes=120 * GIB, seq=seq, global_batch=batch, lora=QLORA,
                    attention_tile_tokens=tile)


def test_which_tiles_are_weighed() -> None:
    assert ATTENTION_TILE_OPTIONS[0] == ATTENTION_TILE_TOKENS
    assert attention_tile_options("llama", 65536) == ATTENTION_TILE_OPTIONS
    assert attention_tile_options("qwen3", 20480) == (8192, 16384)
    assert attention_tile_options("llama", 16384) == ()  # segment attention off: transformers' masks
    assert attention_tile_options("gpt2", 65536) == ()  # not a segment-attention family


def test_the_planner_keeps_the_fastest_tile_that_fits() -> None:
    """8B QLoRA, 2 x 64K tokens on 24 GiB: every tile fits and the largest is the fastest (fewer
    merges); the result is the fixed-tile search's own, the engine's settings carry the tile."""
    chosen = _qlora_8b(65536, 24)
    fixed = {t: _qlora_8b(65536, 24, tile=t) for t in ATTENTION_TILE_OPTIONS}
    seconds = {t: ranking_seconds(r.best, False) for t, r in fixed.items()}
    assert seconds[32768] < seconds[16384] < seconds[8192]
    assert fixed[32768].best.gpu_need > fixed[8192].best.gpu_need  # the trade the search makes
    assert chosen.attention_tile_tokens == 32768
    assert chosen.best.plan == fixed[32768].best.plan
    assert chosen.best.time.step_s == fixed[32768].best.time.step_s
    assert chosen.config_kwargs()["attention_tile_tokens"] == 32768
    assert any("tiles of 32768 tokens" in n for n in chosen.notes)
    assert chosen.considered == sum(r.considered for r in fixed.values())


def test_short_gpu_memory_takes_a_smaller_tile_and_refuses_as_the_smallest() -> None:
    """A GPU budget between the 8K tile's need and the 32K tile's: a smaller tile, not a refusal;
    below the 8K tile's need: the 8K tile's one-line refusal."""
    need = {t: _qlora_8b(65536, 24, tile=t).best.gpu_need for t in ATTENTION_TILE_OPTIONS}
    budget = (need[8192] + need[32768]) / 2 / GIB
    squeezed = _qlora_8b(65536, budget)
    assert squeezed.attention_tile_tokens in (8192, 16384)
    assert squeezed.best.gpu_need <= budget * GIB
    with pytest.raises(PlanDoesNotFitError) as smallest:
        _qlora_8b(131072, 12, tile=8192)
    with pytest.raises(PlanDoesNotFitError) as searched:
        _qlora_8b(131072, 12)
    assert str(searched.value) == str(smallest.value)


def test_short_rows_and_a_fixed_tile_plan_as_before() -> None:
    short = _qlora_8b(8192, 24)
    assert short.attention_tile_tokens == 0
    assert "attention_tile_tokens" not in short.config_kwargs()
    assert not any("tiles of" in n for n in short.notes)
    fixed = _qlora_8b(65536, 24, tile=16384)
    assert fixed.attention_tile_tokens == 16384
    assert not any("the fastest of" in n for n in fixed.notes)


def _long_llama() -> torch.nn.Module:
    model = make_model("llama", layers=2)
    model.config.max_position_embeddings = 32768
    return model


def _shell_tiles(engine: tinypipe.Engine) -> set[int]:
    return {getattr(d.shell.model.config, TILE_ATTR) for d in engine.devices}


def test_the_engine_runs_the_planners_tile() -> None:
    """A planned engine at 20K-token rows on the CPU: its shells attend in the tile the planner
    sized the plan with (one of 8K, 16K); a fixed tile is the shells' tile; short rows keep the
    default (segment attention off there)."""
    model = _long_llama()
    engine = tinypipe.Engine(model, tinypipe.Config(devices=["cpu"], precision="fp32", seq_len=20480,
                                                    global_batch=1))
    assert engine.plan_result is not None
    planned = engine.plan_result.attention_tile_tokens
    assert planned in (8192, 16384)
    assert engine.attention_tile == planned
    assert _shell_tiles(engine) == {planned}
    fixed = tinypipe.Engine(_long_llama(),
                            tinypipe.Config(devices=["cpu"], precision="fp32", seq_len=20480, global_batch=1,
                                            attention_tile_tokens=8192))
    assert fixed.attention_tile == 8192 and _shell_tiles(fixed) == {8192}
    other = 16384 if planned == 8192 else 8192  # the engine follows the planner, not a constant
    chosen = dataclasses.replace(engine.plan_result, sizes=dataclasses.replace(engine.plan_result.sizes,
                                                                               attention_tile=other))
    from tinypipe.runtime.engine import _attention_tile

    assert _attention_tile(tinypipe.Config(seq_len=20480), chosen, None) == other
    assert _attention_tile(tinypipe.Config(seq_len=20480), None, None) is None
    assert torch.get_num_threads() >= 1


def test_the_plan_command_prints_the_tile_and_prices_a_given_plan_at_the_engines(
        capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # noqa: ANN001
    """`tinypipe plan` says which tile it chose and puts it in the Config it prints; `--evaluate`
    prices a saved plan at the default tile, the one the engine runs a given plan with."""
    from tinypipe.cli.plan import EXIT_OK, main

    saved = tmp_path / "plan.json"
    args = ["--model", "llama-3.1-8b", "--hardware", "h200-pcie5", "--gpu-memory", "24GiB",
            "--cpu-memory", "128GiB", "--global-batch", "2", "--seq-len", "65536", "--lora", "--quantize", "nf4"]
    assert main([*args, "--save-plan", str(saved)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "attention in tiles of 32768 tokens" in out and "attention_tile_tokens=32768" in out
    assert main([*args, "--evaluate", str(saved)]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"attention_tile_tokens={ATTENTION_TILE_TOKENS}" in out and "attention in tiles of" not in out
