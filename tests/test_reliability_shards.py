"""Issue #34, checksums of sharded checkpoints: each rank's shard files are recorded (sha256) in the
manifest and checked before they load. A flipped byte in one rank's shard -- the file still parses,
its numbers are wrong -- is refused on every rank with the same line naming that file; before, the
damaged optimizer state was trained on silently."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from _dist_run import finish, launch, run

SPEC = dict(family="llama", layers=2, batch=4, steps=2, save_at=2,
            cfg=dict(pack_size=1, micro_batch_size=2, optimizer_sharding="shard"))


def _flip_a_data_byte(path: Path) -> None:
    """Change one byte of the first tensor's data (after the safetensors header): still loadable."""
    raw = bytearray(path.read_bytes())
    header = struct.unpack("<Q", raw[:8])[0]
    raw[8 + header + 5] ^= 0x40
    path.write_bytes(bytes(raw))


def test_a_damaged_shard_is_refused_on_every_rank(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run(dict(SPEC, ckpt=str(ckpt)), 2, tmp_path / "save")
    victim = ckpt / "rank-00001-of-00002" / "layer-0001.safetensors"
    _flip_a_data_byte(victim)
    procs, outs = launch(dict(SPEC, ckpt=str(ckpt), resume=True), 2, tmp_path / "resume")
    logs = finish(procs, 120)
    for rank, (p, out) in enumerate(zip(procs, outs)):
        err = Path(str(out) + ".err")
        assert p.returncode != 0 and err.exists(), f"rank {rank} resumed from a damaged shard\n{logs[rank][-2000:]}"
        line = err.read_text().splitlines()[0]
        assert line.startswith(f"ConfigError: {victim}: checksum mismatch"), line
        assert "manifest.json records" in line, line
    manifest = json.loads((ckpt / "manifest.json").read_text())
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.glob("rank-*/*.safetensors"))
    assert len(files) == 2 * len(manifest["layers"])
    assert sorted(manifest.get("sha256", {})) == files  # every rank's every file recorded
