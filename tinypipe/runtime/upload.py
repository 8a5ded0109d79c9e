"""One layer's weights onto a device: the upload an UPLOAD task runs, shared with evaluation.

The host master is fp32; a device computing in bf16 gets it through the fp32 staging buffer and
casts there (no host-side cast, no second host copy). A layer whose AdamW state lives on the
device is loaded once (master and moments) and then stays; frozen weights (LoRA) are already at
the compute precision -- a quantized base (QLoRA) as its payload bytes reinterpreted at that
dtype -- and follow the trainable prefix as one plain copy.

State on the SSD (``Plan.offload``) is copied out of the SSD tier's staging slots: in a step, the
slots its stager filled for that upload task (:meth:`SsdTier.upload_sources`); outside a step (an
evaluation), slots of the same upload pool read for this one upload
(:meth:`SsdTier.sources_outside_step`). Either way the slots go back once the copy is done.
"""

from __future__ import annotations

import torch

from tinypipe.memory.host_store import HostStore
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.optim.path import OptimizerPath
from tinypipe.runtime.signals import Abort
from tinypipe.schedule.ids import TaskId


def upload_destination(dev: DeviceRuntime, layer: int, slot: int | None) -> torch.Tensor:
    """The buffer ``layer``'s upload writes on ``dev`` (its ``slot``, or its own resident one).

    A transient weight buffer (schedule/transient_grads.py) is allocated from the compute stream's
    pool: the caching allocator hands a freed block only to later allocations on the stream it was
    made on, and what follows its release -- the activations -- allocates on the compute stream
    (made on the upload stream, the embedding and head weights of a 64K QLoRA row stayed reserved
    and unused: 2 GiB above the allocated peak). A block the compute stream freed may still be read
    by kernels queued there, so the upload stream waits for those before writing into it."""
    pool = dev.pool
    if slot is not None or layer not in pool.transient_weights or pool.params_alive(layer):
        return pool.params(layer, slot)
    compute = dev.streams["compute"]
    with dev.backend.use_stream(compute):
        dst = pool.params(layer, None)
    dev.backend.wait_event(dev.streams["h2d"], dev.backend.record_event(compute))
    return dst


def upload_layer(store: HostStore, optim: OptimizerPath, dev: DeviceRuntime, layer: int, dst: torch.Tensor,
                 abort: Abort | None = None, task_id: TaskId | None = None) -> None:
    """Queue ``layer``'s current weights into ``dst`` (its slot or resident buffer) on the current
    stream, after the last step's leftover update of that layer. ``task_id``: the step's upload
    task this is (its SSD staging); None outside a step."""
    assisted = optim.claim_assisted(layer)
    if assisted is not None:  # the last step's clipped update of this layer, stepped here on the way up
        optim.assist.run(assisted, dev, dst)  # type: ignore[union-attr]
        return
    optim.wait_layer(layer, abort)  # the last step's clipped update of this layer
    src, frozen = store.layers[layer].master, store.layers[layer].frozen
    tier = optim.tier
    if tier is None:
        _copy_layer(optim, dev, layer, dst, src, frozen)
        return
    # state on the SSD: copy out of its staging slots, which go back once the copy is done
    if task_id is not None:  # a step's: its stager's slots (a failed step's go back in abandon_step)
        src, frozen, staged = tier.upload_sources(task_id, layer, src, frozen)
        _copy_layer(optim, dev, layer, dst, src, frozen)
        if staged is not None:
            dev.backend.sync_event(dev.backend.record_event(dev.streams["h2d"]))
            tier.uploaded(task_id, staged)
        return
    src, frozen, staged = tier.sources_outside_step(layer, src, frozen, abort)
    try:
        _copy_layer(optim, dev, layer, dst, src, frozen)
        if staged is not None:
            dev.backend.sync_event(dev.backend.record_event(dev.streams["h2d"]))
    finally:
        if staged is not None:
            staged.release()


def _copy_layer(optim: OptimizerPath, dev: DeviceRuntime, layer: int, dst: torch.Tensor, src: torch.Tensor,
                frozen: torch.Tensor | None) -> None:
    """Upload ``layer`` (master ``src``, frozen weights ``frozen``) into ``dst``."""
    # stepped on the device: loaded (master and moments) once, resident from then on
    on_device = optim.on_device(layer)
    if on_device and not optim.load_on_device(layer, dst):
        return
    staging = dev.pool.staging
    n = src.numel()
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
