"""bench/long_context.py's CPU-runnable logic (issue #32): the model-FLOPs formula against
Megatron-LM's closed form, argument parsing, the planner's refusals and the time budget, and one
tiny row end to end on the CPU (chunked MLP, raw JSON, the table)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import long_context as lc

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_model_flops_is_megatrons_formula() -> None:
    """A GPT-like shape (MLP 4h, not gated, multi-head attention, full attention): exactly
    72 B s l h^2 (1 + s/6h + V/12lh); causal masking halves the attention term."""
    h, l, V, s, B = 1024, 12, 50000, 4096, 3
    dims = dict(hidden_size=h, intermediate_size=4 * h, num_attention_heads=16, num_hidden_layers=l,
                vocab_size=V, gated=False)
    megatron = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert lc.model_flops(dims, s, B, causal=False) == pytest.approx(megatron, rel=1e-12)
    attention = 72 * B * s * l * h * h * s / (6 * h)
    assert lc.model_flops(dims, s, B, causal=True) == pytest.approx(megatron - attention / 2, rel=1e-12)


def test_8b_flops_at_128k_are_mostly_attention() -> None:
    d = lc.SHAPES["8b"]
    total = lc.model_flops(d, 131072, 2)
    dense = lc.model_flops(d, 1, 2 * 131072)  # the same tokens as one-token sequences: matmuls alone
    assert total > 2 * dense  # causal attention at 128K costs more than all the matmuls
    assert lc.model_flops(d, 2048, 16) == pytest.approx(6 * 2048 * 16 * 7.5e9, rel=0.05)


def test_arguments() -> None:
    a = lc.parse(["--rows", "8b-full-64k,3b-full-128k", "--cpu-gib", "120", "--plan-only"])
    assert a.names == ["8b-full-64k", "3b-full-128k"] and a.cpu_gib == 120 and a.budget_s == 530
    assert lc.parse([]).names == list(lc.ROWS)
    with pytest.raises(SystemExit):
        lc.parse(["--rows", "8b-full-1m"])


def test_refusals_and_the_time_budget_skip_rows(tmp_path: Path) -> None:
    """Real shapes, planning only: 8B full fine-tuning at 128K on 24 GiB is refused with what it
    needs; with a budget of 60 s nothing is run, each row saying why."""
    out = tmp_path / "r"
    assert lc.main(["--rows", "8b-full-128k,8b-qlora-64k", "--cpu-gib", "128", "--budget-s", "60",
                    "--out", str(out)]) == 0
    refused = json.loads((out / "8b-full-128k.json").read_text())
    assert refused["skipped"].startswith("planner: needs") and "GiB GPU memory" in refused["skipped"]
    budget = json.loads((out / "8b-qlora-64k.json").read_text())
    assert budget["skipped"].startswith("time budget") and budget["planned"]["mlp_chunk_tokens"] == 8192


def test_the_ssd_row_plans_128k_full_fine_tuning_within_its_host_budget(tmp_path: Path) -> None:
    """Real shape, planning only: what 128 GiB of DRAM refuses (the row above), the SSD tier
    fits -- under the row's 120 GiB host budget and the 24 GiB cap, the moments on the disk (with
    the embedding's and head's gradient accumulators transient: schedule/transient_grads.py)."""
    a = lc.parse(["--rows", "8b-full-128k-ssd", "--cpu-gib", "128", "--plan-only",
                  "--offload-dir", str(tmp_path)])
    row = lc.ROWS["8b-full-128k-ssd"]
    p = lc.plan_row(row, row.seq, a)
    assert p["fits"], p.get("reason")
    assert "offload: moments" in p["plan"] and p["mlp_chunk_tokens"] > 0
    assert p["host_need"] <= 120 * lc.GiB and p["gpu_need"] <= 24 * lc.GiB
    assert not lc.plan_row(lc.ROWS["8b-full-128k"], row.seq, a)["fits"]


def test_one_tiny_row_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny"
    assert lc.main(["--tiny", "--in-process", "--rows", "8b-full-64k", "--out", str(out)]) == 0
    rec = json.loads((out / "8b-full-64k.json").read_text())
    assert rec["seq"] == 64 and rec["mlp_chunk_tokens"] == lc.TINY_MLP_CHUNK
    assert rec["tokens_per_step"] == 128 and rec["tokens_per_s"] > 0 and rec["model_tflops"] > 0
    assert rec["losses"][-1] < rec["losses"][0] and rec["planned"]["fits"]
    assert "8b-full-64k" in capsys.readouterr().out.splitlines()[-1]


def test_a_tiny_packed_row_attends_per_document(tmp_path: Path) -> None:
    """The packed row (8 documents per row) runs segment attention and counts attention per
    document: its model FLOPs are below the one-document row's at the same length."""
    out = tmp_path / "tiny"
    assert lc.main(["--tiny", "--in-process", "--rows", "8b-full-64k-packed", "--out", str(out)]) == 0
    rec = json.loads((out / "8b-full-64k-packed.json").read_text())
    assert rec["segment_attention"] and rec["losses"][-1] < rec["losses"][0]
    dims = lc._dims(lc.ROWS["8b-full-64k"], True)
    assert rec["model_flops_per_step"] < lc.model_flops(dims, rec["seq"], 2)
