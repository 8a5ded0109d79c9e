"""The estimated activation peak taken apart (``planner/estimate.py`` ``activation_breakdown``):
its parts add up to the peak the search sizes plans by, in the phase it names, for every kind of
plan; what it names is what the model counts; ``tinypipe plan`` prints it per device and a plan
refused for GPU memory names its four largest parts."""

from __future__ import annotations

import pytest

from tinypipe.cli.plan import EXIT_NO_FIT, main
from tinypipe.errors import PlanDoesNotFitError
from tinypipe.lora.settings import LoraSettings
from tinypipe.planner.estimate import activation_breakdown, activation_peaks
from tinypipe.planner.presets import load_model_config
from tinypipe.planner.search import plan_for
from tinypipe.planner.sizes import lora_sizes
from tinypipe.schedule.plan import make_plan
from tinypipe.units import GIB

NF4 = LoraSettings(rank=16, alpha=32.0, quantize="nf4", compute_dtype="bf16")

#: searches whose plans cover the estimate's terms: kept packs and a micro-batch-wise turn (3B at
#: 2K), two GPUs (stash boundaries and read-ahead on each), QLoRA at 64K (chunked MLPs, host-stashed
#: boundaries and gradients, attention tiles), 70B QLoRA (many packs, transient weights)
SEARCHES = {
    "3b": ("llama-3.2-3b", dict(gpus=1, gpu_memory_bytes=24 * GIB, cpu_memory_bytes=120 * GIB, seq=2048,
                                global_batch=16)),
    "3b-2gpu": ("llama-3.2-3b", dict(gpus=2, gpu_memory_bytes=24 * GIB, cpu_memory_bytes=120 * GIB, seq=2048,
                                     global_batch=16, max_grad_norm=1.0)),
    "8b-qlora-64k": ("llama-3.1-8b", dict(gpus=1, gpu_memory_bytes=24 * GIB, cpu_memory_bytes=120 * GIB,
                                          seq=65536, global_batch=2, lora=NF4)),
    "70b-qlora": ("llama-3.1-70b", dict(gpus=1, gpu_memory_bytes=24 * GIB, cpu_memory_bytes=64 * GIB, seq=2048,
                                        global_batch=8, lora=NF4)),
}


@pytest.mark.parametrize("name", sorted(SEARCHES))
def test_the_parts_add_up_to_the_peak_the_search_sized(name: str) -> None:
    """Every Pareto plan of the search: per device, the parts sum to the candidate's
    ``activations_peak`` (to the bytes the float per-token counts truncate: one per part) in the
    phase :func:`activation_peaks` names, and no part is empty."""
    model, kw = SEARCHES[name]
    result = plan_for(load_model_config(model), "h200-pcie5", **kw)
    assert len(result.pareto) >= 1
    kinds = set()
    for cand in result.pareto:
        breakdown = result.peak_breakdown(cand)
        peaks = [cats["activations_peak"] for cats in cand.memory.devices.values()]
        assert len(breakdown) == len(peaks) == cand.plan.num_devices
        _, phases = activation_peaks(result.sizes, cand.plan, batch=result.global_batch, seq=result.seq,
                                     precision=result.precision, devices=[f"cuda:{i}" for i in range(len(peaks))],
                                     detail=True, mlp_chunk=result.mlp_chunk_tokens)
        for peak, b, phase in zip(peaks, breakdown, phases):
            assert 0 <= peak - b.total <= len(b.parts), (name, cand.describe(), peak, b)
            assert b.phase == phase and all(v > 0 for _, v in b.parts)
            assert [v for _, v in b.parts] == sorted((v for _, v in b.parts), reverse=True)
            kinds.update(label for label, _ in b.parts)
    assert "CUDA workspaces" in kinds


@pytest.mark.parametrize("name", sorted(SEARCHES))
def test_every_phase_is_labelled_in_full(name: str) -> None:
    """Not only the peak's phase: in every phase of every device, what the labelled ledger names adds
    up to what the search's unlabelled one counts there (a term entered without its label, or twice,
    would show in some phase)."""
    from tinypipe.planner import estimate

    model, kw = SEARCHES[name]
    result = plan_for(load_model_config(model), "h200-pcie5", **kw)
    for cand in result.pareto:
        devices = [f"cuda:{i}" for i in range(cand.plan.num_devices)]
        ledgers = [estimate._Ledger(len(devices), 2 * cand.plan.num_packs + 4, labelled=flag) for flag in (False, True)]
        for ledger in ledgers:
            estimate._account(ledger, result.sizes, cand.plan, batch=result.global_batch, seq=result.seq,
                              precision=result.precision, devices=devices, hidden=None, vocab=None, head_chunk=None,
                              act_per_token=None, mlp_chunk=result.mlp_chunk_tokens)
        plain, labelled = ledgers
        for d in range(len(devices)):
            run = 0
            for k, load in enumerate(plain.load[d]):
                run += plain.delta[d][k]
                parts = labelled.parts(d, k)
                assert 0 <= run + load + plain.fixed[d] - sum(b for _, b in parts) <= len(parts) + 1, (k, parts)


def _long_qlora(batch: int, tile: int = 8192):  # noqa: ANN202
    cfg = load_model_config("llama-3.1-8b")
    cfg.max_position_embeddings = 262144
    import dataclasses

    sizes = dataclasses.replace(lora_sizes(cfg, NF4), attention_tile=tile)
    plan = make_plan(sizes.num_blocks, pack_size=1, micro_batch_size=1, backward_micro_batch_size=1,
                     num_devices=1, prefetch_window=1, stash="host", tied=sizes.tied)
    b, = activation_breakdown(sizes, plan, batch=batch, seq=262144, precision="bf16", devices=["cuda:0"],
                              mlp_chunk=8192)
    return dict(b.parts), b


def test_what_a_second_256k_sequence_adds_is_named() -> None:
    """8B QLoRA at 256K tokens a sequence, micro-batch 1: a second sequence adds the host stash's
    two read-ahead buffers of one micro-batch's rows (absent with one micro-batch: nothing to read
    ahead) and doubles the head's whole-batch input gradient; the block's own terms stay."""
    rows = 262144 * 4096 * 2  # one micro-batch's rows, bf16
    one, b1 = _long_qlora(1)
    two, b2 = _long_qlora(2)
    assert b1.phase == b2.phase == "backward pack 31"
    assert "host-stash read-ahead buffers" not in one
    assert two["host-stash read-ahead buffers"] == 2 * rows
    assert one["boundary gradients"] == rows and two["boundary gradients"] == 2 * rows
    for same in ("the pack's recomputed saved activations", "attention backward temporaries", "input rows copied in"):
        assert one[same] == two[same] > 0
    assert b2.total - b1.total == 3 * rows


def test_a_larger_attention_tile_shows_as_its_backward_temporaries() -> None:
    """The tile the planner weighs changes the attention backward's term and nothing else."""
    small, _ = _long_qlora(1, tile=8192)
    large, _ = _long_qlora(1, tile=32768)
    assert large["attention backward temporaries"] > small["attention backward temporaries"]
    assert {k: v for k, v in small.items() if k != "attention backward temporaries"} == \
        {k: v for k, v in large.items() if k != "attention backward temporaries"}


def test_a_refusal_names_the_largest_parts_and_plan_prints_them(capsys: pytest.CaptureFixture[str]) -> None:
    """2 x 256K QLoRA does not fit 24 GiB: the one-line refusal names the leanest plan's four
    largest parts; a plan that fits prints every device's breakdown under its memory."""
    cfg = load_model_config("llama-3.1-8b")
    cfg.max_position_embeddings = 262144
    with pytest.raises(PlanDoesNotFitError) as err:
        plan_for(cfg, "h200-pcie5", gpus=1, gpu_memory_bytes=24 * GIB, cpu_memory_bytes=120 * GIB, seq=262144,
                 global_batch=2, lora=NF4)
    text = str(err.value)
    assert "\n" not in text and "its activation peak (backward pack 31) holds " in text
    assert "the pack's recomputed saved activations" in text and "attention backward temporaries" in text
    assert "host-stash read-ahead buffers 4.0 GiB" in text  # what the second sequence adds (above)
    argv = ["--model", "llama-3.2-3b", "--gpus", "2", "--gpu-memory", "24GiB", "--cpu-memory", "120GiB",
            "--seq-len", "2048", "--global-batch", "16", "--hardware", "h200-pcie5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for dev in ("0:cuda:0", "1:cuda:1"):
        i = next(n for n, line in enumerate(lines) if line.startswith(f"  {dev}: "))
        assert lines[i + 1].startswith("    activations peak (") and "CUDA workspaces" in lines[i + 1]
    assert main([*argv[:5], "1GiB", *argv[6:]]) == EXIT_NO_FIT
