"""One layer's weights onto a device: the upload an UPLOAD task runs, shared with evaluation.

The host master is fp32; a device computing in bf16 gets it through the fp32 staging buffer and
casts there (no host-side cast, no second host copy). A layer whose AdamW state lives on the
device is loaded once (master and moments) and then stays; frozen weights (LoRA) are already at
the compute precision and follow the trainable prefix.
"""

from __future__ import annotations

import torch

from tinypipe.memory.host_store import HostStore
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.optim.path import OptimizerPath
from tinypipe.runtime.signals import Abort


def upload_layer(store: HostStore, optim: OptimizerPath, dev: DeviceRuntime, layer: int, dst: torch.Tensor,
                 abort: Abort | None = None) -> None:
    """Queue ``layer``'s current weights into ``dst`` (its slot or resident buffer) on the current
    stream, after the last step's leftover update of that layer."""
    optim.wait_layer(layer, abort)  # the last step's clipped update of this layer
    src = store.layers[layer].master
    # stepped on the device: loaded (master and moments) once, resident from then on
    on_device = optim.on_device(layer)
    if on_device and not optim.load_on_device(layer, dst):
        return
    staging = dev.pool.staging
    n = src.numel()
    frozen = store.layers[layer].frozen
    if frozen is not None:  # already at the compute precision: one plain copy after the prefix
        dst[n : n + frozen.numel()].copy_(frozen, non_blocking=True)
    if on_device:
        return
    if staging is None:
        dst[:n].copy_(src, non_blocking=True)
        return
    span = staging.numel()
    for lo in range(0, n, span):
        hi = min(n, lo + span)
        staging[: hi - lo].copy_(src[lo:hi], non_blocking=True)
        dst[lo:hi].copy_(staging[: hi - lo])
