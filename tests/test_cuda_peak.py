"""The replay of the CUDA allocator's event history (bench/benchkit/cuda_peak.py) on traces in its
format: the peak it finds and what it says was alive then, against sums worked by hand."""

from __future__ import annotations

import pytest
import torch

from benchkit.cuda_peak import peak_breakdown, record_step

MiB = 1024**2


def _frames(*where: tuple[str, int, str]) -> list[dict]:
    return [{"filename": f, "line": line, "name": n} for f, line, n in where]  # innermost first


ATTN = _frames(("/x/torch/nn/functional.py", 10, "scaled_dot_product_attention"),
               ("/x/transformers/models/llama/modeling_llama.py", 200, "forward"),
               ("/x/tinypipe/runtime/compute_handlers.py", 300, "_bwd"))
MLP = _frames(("/tmp/torchinductor_root/ab/cab.py", 50, "call"),
              ("/x/torch/_inductor/output_code.py", 5, "__call__"),
              ("/x/tinypipe/runtime/compute_handlers.py", 300, "_bwd"))
HEAD = _frames(("/x/tinypipe/models/head.py", 40, "fused_head_chunk"),
               ("/x/tinypipe/runtime/compute_handlers.py", 250, "_head"))


def _alloc(addr: int, mib: int, frames: list[dict]) -> dict:
    return {"action": "alloc", "addr": addr, "size": mib * MiB, "frames": frames, "stream": 0}


def _free(addr: int, mib: int, completed: bool = True) -> list[dict]:
    out = [{"action": "free_requested", "addr": addr, "size": mib * MiB, "frames": [], "stream": 0}]
    if completed:
        out.append({"action": "free_completed", "addr": addr, "size": mib * MiB, "frames": [], "stream": 0})
    return out


def test_the_peak_and_what_was_alive_then() -> None:
    """Head: 100 MiB, freed; backward: 3 x 64 MiB of attention and 2 x 32 MiB of the compiled MLP
    (peak: 256 MiB over the 1000 MiB baseline), then everything freed and a larger block later that
    does not reach the peak."""
    trace = [_alloc(1, 100, HEAD), *_free(1, 100),
             _alloc(2, 64, ATTN), _alloc(3, 64, ATTN), _alloc(4, 32, MLP), _alloc(5, 64, ATTN),
             _alloc(6, 32, MLP),
             *_free(2, 64), *_free(3, 64, completed=False), *_free(4, 32), *_free(5, 64), *_free(6, 32),
             _alloc(7, 200, HEAD), *_free(7, 200),
             {"action": "segment_alloc", "addr": 99, "size": 2048 * MiB, "frames": [], "stream": 0}]
    out = peak_breakdown(trace, baseline=1000 * MiB)
    assert out["peak_allocated"] == 1256 * MiB and out["alive_at_peak"] == 256 * MiB
    assert out["peak_event"] == 7  # the second compiled-MLP block (entries 0-2: the head)
    first, second = out["groups"]
    assert (first["ours"], first["library"], first["bytes"], first["blocks"]) == (
        "runtime/compute_handlers.py:300 (_bwd)", "nn/functional.py:10 (scaled_dot_product_attention)",
        192 * MiB, 3)
    assert second["innermost"] == "ab/cab.py:50 (call)" and second["bytes"] == 64 * MiB
    assert second["library"] == "_inductor/output_code.py:5 (__call__)"


def test_a_block_from_before_the_trace_and_the_top_cut() -> None:
    """Freeing a block allocated before recording began lowers the count below the baseline; groups
    past ``top`` are summed in ``other_bytes``."""
    trace = [*_free(50, 300), _alloc(1, 10, HEAD), _alloc(2, 20, ATTN), _alloc(3, 30, MLP)]
    out = peak_breakdown(trace, baseline=500 * MiB, top=2)
    assert out["peak_allocated"] == 500 * MiB  # 200 + 60 never reaches the baseline again
    assert out["groups"] == [] and out["alive_at_peak"] == 0
    out = peak_breakdown(trace[1:], baseline=0, top=2)
    assert [g["bytes"] for g in out["groups"]] == [30 * MiB, 20 * MiB] and out["other_bytes"] == 10 * MiB


@pytest.mark.gpu
def test_record_step_sees_a_known_allocation_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def step() -> None:
        a = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda:0")
        b = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda:0")
        del a, b

    out = record_step(step, "cuda:0")
    assert out["complete"] and out["peak_allocated"] - out["baseline"] == 384 * MiB
    assert out["groups"][0]["ours"] == "?" and "test_cuda_peak.py" in out["groups"][0]["innermost"]
