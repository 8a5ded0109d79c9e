"""A one-rank process group (``Config.extra["dp_single_rank"]``) runs every collective of the
replicas -- per-layer reductions on the collective lanes, the sharded optimizer's reduce-scatter,
norm all-reduce and all-gather, the loss and token sums, the fingerprint check, the non-finite
decision and the sharded checkpoint -- and each is an identity over one rank, so training must be
bit-identical to the same engine without replicas (losses, gradient norms, clip and skip
decisions, weights), and a resumed sharded checkpoint must continue bit-identically.

On the CPU the collectives are gloo's (CI covers the one-rank path). On a GPU (``gpu``) each CUDA
device's lane is an NCCL group: the real async NCCL ops on CUDA streams ordered by events, which
cannot be run with two ranks on a one-GPU machine. There the bar is the device's own run-to-run
determinism: the plain engine is trained twice, and the replica must equal it bit for bit when
those two runs agree (cuBLAS pinned by CUBLAS_WORKSPACE_CONFIG; if a kernel still is not
deterministic, to the equivalence tests' float rounding, with a warning that says so).
The share mode (two ranks on one GPU over gloo, CUDA tensors through gloo) is tested against one
process at float rounding: splitting the batch over ranks reorders the gradient sums."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent

LLAMA = dict(family="llama", batch=4, steps=3, save_at=2)
CPU_CASES = {
    # clip 0.5 triggers every step (the speculative step undone and redone)
    "replicate_clip": dict(LLAMA, cfg=dict(pack_size=1, micro_batch_size=2, max_grad_norm=0.5,
                                           optimizer_sharding="replicate")),
    "shard_clip": dict(LLAMA, cfg=dict(pack_size=2, micro_batch_size=2, backward_micro_batch_size=1,
                                       max_grad_norm=0.5, optimizer_sharding="shard")),
    "shard_noclip_two_devices": dict(LLAMA, cfg=dict(devices=["cpu", "cpu"], pack_size=1, micro_batch_size=1,
                                                     optimizer_sharding="shard")),
    # a NaN in layer 2's gradient at step 2: skipped by both, through the reduction and the norm
    "shard_nan_skip": dict(family="llama", batch=4, steps=3, poison=(1, 2),
                           cfg=dict(pack_size=1, micro_batch_size=2, nonfinite="skip", max_grad_norm=1.0,
                                    optimizer_sharding="shard")),
}


def _on_gpu(cases: dict) -> dict:
    out = {}
    for name, case in cases.items():
        devices = ["cuda:0" if d == "cpu" else d for d in case["cfg"].get("devices", ["cpu"])]
        # eager blocks: the collectives are the subject, and 16 engines would each compile
        out[name] = dict(case, cfg=dict(case["cfg"], devices=devices, compile_blocks="off"))
    return out


def run_single(cases: dict, tmp: Path, timeout: float = 600.0) -> dict:
    """Run ``cases`` in one subprocess that is a one-rank group (tests/_dist_single.py)."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec_path, out = tmp / "spec.pt", tmp / "out.pt"
    torch.save({"cases": cases, "store": str(tmp / "store")}, spec_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(HERE / "_dist_single.py"), str(spec_path), str(out)], env=env,
                          cwd=str(HERE.parent), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    err = Path(str(out) + ".err")
    assert proc.returncode == 0, (err.read_text() if err.exists() else "") + proc.stdout[-4000:]
    return torch.load(out, weights_only=False)


def differences(a: dict, b: dict) -> list[str]:
    """Where two runs differ at all (decisions, losses, norms -- as exact reprs, a NaN equal to a
    NaN -- and every state tensor)."""
    out = [k for k in ("losses", "norms", "clipped", "skipped")
           if list(map(repr, a[k])) != list(map(repr, b[k]))]
    for k, v in a["state"].items():
        if not torch.equal(v, b["state"][k]):
            out.append(f"{k} (max |diff| {float((v - b['state'][k]).abs().max()):.3g})")
    return out


def beyond_rounding(a: dict, b: dict) -> list[str]:
    """Where two runs differ by more than the equivalence tests' tolerances (1e-5 relative on
    losses, norms and each tensor) or in a decision."""
    out = [k for k in ("clipped", "skipped") if a[k] != b[k]]
    for k in ("losses", "norms"):
        if any(not abs(x - y) <= 1e-5 * abs(y) and not (x != x and y != y) for x, y in zip(a[k], b[k])):
            out.append(f"{k}: {a[k]} vs {b[k]}")
    for k, v in a["state"].items():
        ref = b["state"][k]
        if float((v - ref).norm()) > 1e-5 * max(float(ref.norm()), 1e-12):
            out.append(k)
    return out


def check_case(name: str, case: dict, r: dict) -> None:
    plain, rep = r["plain"], r["replica"]
    assert any(lane.endswith(":collective") for lane in rep["lanes"]), rep["lanes"]  # the reductions ran
    assert not any(lane.endswith(":collective") for lane in plain["lanes"]), plain["lanes"]
    assert rep["sharding"] == case["cfg"]["optimizer_sharding"]
    devices = case["cfg"].get("devices", ["cpu"])
    assert rep["backends"] == ["nccl" if d.startswith("cuda") else "gloo" for d in devices], rep["backends"]
    assert rep["optimizer_bytes"] == plain["optimizer_bytes"]  # one shard: the whole state
    compare = differences  # bit for bit, unless the device itself is not (then to float rounding)
    if "plain_again" in r and differences(r["plain_again"], plain):
        warnings.warn(f"{name}: the plain engine is not bit-reproducible on this device "
                      f"({differences(r['plain_again'], plain)[:3]}); the replica checked to float rounding")
        compare = beyond_rounding
    assert not compare(rep, plain), compare(rep, plain)
    if case.get("poison") is not None:
        assert rep["skipped"] == [i == case["poison"][0] for i in range(case["steps"])], rep["skipped"]
    if case.get("save_at"):
        want = ["manifest.json", "rank-00000-of-00001"] if rep["sharding"] == "shard" else None
        if want is not None:
            assert r["ckpt_files"] == want, r["ckpt_files"]
        tail = {k: rep[k][case["save_at"]:] for k in ("losses", "norms", "clipped", "skipped")}
        assert not compare(r["resumed"], dict(rep, **tail)), compare(r["resumed"], dict(rep, **tail))


def test_one_rank_gloo_equals_no_replicas(tmp_path: Path) -> None:
    results = run_single(CPU_CASES, tmp_path)
    for name, case in CPU_CASES.items():
        check_case(name, case, results[name])
    clipped = results["replicate_clip"]["replica"]["clipped"]
    assert all(clipped), clipped  # the clip path ran


@pytest.mark.gpu
def test_one_rank_nccl_equals_no_replicas(tmp_path: Path) -> None:
    """The same cases on cuda:0 (two device entries: two NCCL groups on one GPU)."""
    cases = _on_gpu(CPU_CASES)
    results = run_single(cases, tmp_path)
    for name, case in cases.items():
        check_case(name, case, results[name])


@pytest.mark.gpu
@pytest.mark.parametrize("sharding", ["replicate", "shard"])
def test_two_ranks_sharing_one_gpu_over_gloo_equal_one_process(sharding: str, tmp_path: Path) -> None:
    """The share mode: two ranks on cuda:0, their gradients summed by gloo over CUDA tensors
    (all-reduces only: gloo's CUDA support), against torch AdamW on the whole global batch."""
    from _dist_check import assert_exact
    from _dist_run import run

    spec = dict(family="llama", batch=4, steps=3, cuda=True, extra={"dp_share_devices": True},
                cfg=dict(devices=["cuda:0"], pack_size=1, micro_batch_size=2, max_grad_norm=0.5,
                         optimizer_sharding=sharding, compile_blocks="off"))
    results = run(spec, 2, tmp_path)
    assert_exact(spec, results)
    assert all(r["sharding"] == sharding for r in results)
