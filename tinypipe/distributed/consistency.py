"""The start-up check: every rank must train the same thing. Each rank's fingerprint (the config
as given, the plan, the model's class, shape and a checksum of its initial weights) is gathered;
a rank that differs is refused on every rank with one line naming the first differing field."""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from tinypipe.config import Config
from tinypipe.distributed.collectives import Collectives
from tinypipe.errors import ConfigError

SAMPLE_STRIDE = 4099  # weights checksum: every 4099th element of each buffer (a prime: no aliasing)


def weights_checksum(buffers: list[torch.Tensor]) -> str:
    """A cheap checksum of the initial weights: strided samples of each flat buffer, hashed as
    bytes (same initial weights on every rank give the same string; a different seed does not)."""
    h = hashlib.sha256()
    for b in buffers:
        if b.numel():
            h.update(b.reshape(-1)[::SAMPLE_STRIDE].to(torch.float32).cpu().numpy().tobytes())
            h.update(str(b.numel()).encode())
    return h.hexdigest()[:16]


def fingerprint(config: Config, plan_json: str, model_class: str, model_config: str,
                weights: str, world_size: int) -> dict[str, str]:
    """Field name -> value string; config fields under ``config.<name>``."""
    out = {f"config.{f.name}": repr(getattr(config, f.name)) for f in dataclasses.fields(config)}
    out.update({"plan": plan_json, "model class": model_class, "model config": model_config,
                "initial weights checksum": weights, "world size": str(world_size)})
    return out


def check_consistent(host: Collectives, mine: dict[str, str]) -> None:
    """Gather every rank's fingerprint; ConfigError (raised on every rank) naming the first field
    where a rank differs from rank 0."""
    every = host.all_gather_object(mine)
    ref = every[0]
    assert isinstance(ref, dict)
    for rank, other in enumerate(every[1:], start=1):
        assert isinstance(other, dict)
        for key in sorted(set(ref) | set(other)):
            a, b = ref.get(key), other.get(key)
            if a != b:
                raise ConfigError(f"replicas disagree on {key}: rank 0 has {_short(a)}, rank {rank} has "
                                  f"{_short(b)}; start every rank with the same command and model")


def _short(value: str | None, limit: int = 80) -> str:
    text = "(missing)" if value is None else value
    return text if len(text) <= limit else text[: limit - 3] + "..."
