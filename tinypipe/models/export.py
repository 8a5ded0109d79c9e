"""Write master weights as a Hugging Face model directory (config + sharded safetensors)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file
from torch import nn

SHARD_BYTES = 2 * 1024**3


def save_hf_directory(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write ``config.json`` (+ generation config) and weights that ``from_pretrained`` loads.

    ``tensors`` yields canonical names (tied aliases omitted, as transformers expects) and is
    consumed lazily, one shard in memory at a time. Each file is written to a temporary name and
    renamed, so an interrupted save never leaves a half-written file under the final name.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)  # never mutate the live model's config
    if dtype is not None:
        config.dtype = str(dtype).replace("torch.", "")
    config.save_pretrained(out)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(out)
        except Exception:  # noqa: BLE001 - an odd generation config must not block saving weights
            pass
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    files: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0

    def flush(final: bool) -> None:
        if not shards[-1]:
            return
        idx = len(files) + 1
        name = f"model-{idx:05d}.safetensors"
        tmp = out / (name + ".tmp")
        save_file(shards[-1], str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / name)
        files.append(name)
        for k in shards[-1]:
            weight_map[k] = name
        shards.append({})
        sizes.append(0)

    for name, t in tensors:
        t = t.detach().to(dtype or t.dtype).contiguous().clone()
        nbytes = t.numel() * t.element_size()
        if sizes[-1] and sizes[-1] + nbytes > shard_bytes:
            flush(False)
        shards[-1][name] = t
        sizes[-1] += nbytes
        total += nbytes
    flush(True)
    if len(files) == 1:
        os.replace(out / files[0], out / "model.safetensors")
        stale = out / "model.safetensors.index.json"
        if stale.exists():
            stale.unlink()
    else:
        final = {}
        for i, f in enumerate(files):
            new = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            os.replace(out / f, out / new)
            final[f] = new
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: final[v] for k, v in weight_map.items()}}
        tmp = out / "model.safetensors.index.json.tmp"
        tmp.write_text(json.dumps(index, indent=2))
        os.replace(tmp, out / "model.safetensors.index.json")
    return out
