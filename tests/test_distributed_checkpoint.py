"""Checkpoints of replicas: a sharded checkpoint (each rank's shard + rank 0's manifest, committed
once every rank wrote) resumed by the same world size continues bit-identically to the run that
was never interrupted (clipping on, so the resumed step must also take the saved speculation
path); a replicated one likewise; another world size is refused; save_pretrained writes once
(rank 0), the whole model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _dist_run import finish, launch, run


@pytest.mark.parametrize("sharding", ["shard", "replicate"])
def test_resume_is_bit_identical(sharding: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    spec = dict(family="llama", batch=4, steps=4, ckpt=str(ckpt), save_at=2,
                cfg=dict(pack_size=2, micro_batch_size=2, max_grad_norm=1.2, optimizer_sharding=sharding))
    whole = run(dict(spec, pretrained=str(tmp_path / "hf")), 2, tmp_path / "whole")
    if sharding == "shard":
        assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", "rank-00000-of-00002",
                                                          "rank-00001-of-00002"]
    resumed = run(dict(spec, resume=True), 2, tmp_path / "resumed")
    for a, b in zip(whole, resumed):
        assert a["losses"][2:] == b["losses"] and a["norms"][2:] == b["norms"]
        for k, v in a["state"].items():
            assert torch.equal(v, b["state"][k]), k
    if sharding != "shard":
        return
    procs, outs = launch(dict(spec, batch=6, resume=True), 3, tmp_path / "three")  # another world size
    finish(procs, 120)
    for o in outs:
        line = Path(str(o) + ".err").read_text().splitlines()[0]
        assert ("saved by 2 ranks, this run has 3: resume a sharded checkpoint with the same world "
                "size") in line
    from safetensors.torch import load_file  # the saved model: every rank's (gathered) weights

    saved = load_file(str(next((tmp_path / "hf").glob("*.safetensors"))))
    for k, v in saved.items():
        assert torch.equal(v, whole[0]["state"][k]), k
