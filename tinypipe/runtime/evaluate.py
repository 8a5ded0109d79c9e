"""Held-out loss through the engine, forward only: no optimizer, no stash, no gradient work.

The layers run in order through the same slots and the same upload path as a training step
(:func:`~tinypipe.runtime.upload.upload_layer`): the weights are the engine's one host copy,
streamed in -- never a second copy of the model. Each layer runs over all of the batch's
micro-batches while it is on its device, so every layer is uploaded once per evaluated batch; on
CUDA the next layers' uploads (as many as the device has slots) run on the upload stream while a
layer computes. The head computes the token cross-entropy in chunks (no full logits, no
gradients). A layer whose last update is still running in the background (clipping) is waited
for, exactly as the next step's upload would. A master (or frozen base) on the SSD is read
through the SSD tier's upload pool, one upload at a time; a QLoRA base arrives as its quantized
bytes, rebuilt by the shell's binding as in training.

Semantics: eval mode on every shell (no dropout; a training-mode engine gets training mode back
afterwards), and the batch's position ids as the training forward passes them, so packed rows
attend within their documents and a document's last token predicts nothing of the next one.

Activations: the batch's hidden states (rows x tokens x hidden, compute precision) stay on the
device from one layer to the next, at most one pack boundary's worth of what a training step with
``stash="device"`` holds -- evaluate in batches no larger than the training batch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tinypipe.models.decompose import map_tensors, slice_rows
from tinypipe.models.head import IGNORE
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.inputs import StepInputs
from tinypipe.runtime.resources import EngineResources
from tinypipe.runtime.upload import upload_destination, upload_layer
from tinypipe.schedule.plan import Plan


@dataclass(frozen=True)
class EvalResult:
    """The loss of one evaluated batch: the mean token cross-entropy over its labelled tokens
    (as ``model(input_ids, labels=labels).loss`` computes it), and how it was obtained."""

    loss: float
    tokens: int  # labelled tokens (the loss's denominator)
    seconds: float

    @property
    def loss_sum(self) -> float:
        """Summed token loss: combine batches as ``sum(loss_sum) / sum(tokens)``."""
        return self.loss * self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else float("inf")


@dataclass(frozen=True)
class _Stage:
    layer: int
    dev: DeviceRuntime
    slot: int | None  # None: the layer's resident buffer


class Evaluator:
    """Forward-only passes with an engine's resources and plan (one per engine)."""

    def __init__(self, res: EngineResources, plan: Plan) -> None:
        self.res = res
        self.plan = plan
        self.stages = self._stages()

    def _stages(self) -> list[_Stage]:
        """Every layer in forward order, on its forward device, in a slot (round robin over the
        device's slots) unless resident there."""
        res, plan = self.res, self.plan
        devs = res.devices
        out = [_Stage(0, devs[plan.embed_device], None)]
        used = {d.index: 0 for d in devs}
        for q, pack in enumerate(plan.packs):
            dev = devs[plan.fwd_device[q] if plan.fwd_device else 0]
            for block in pack:
                layer = block + 1
                if layer in dev.pool.resident:
                    out.append(_Stage(layer, dev, None))
                    continue
                out.append(_Stage(layer, dev, used[dev.index] % len(dev.pool.slots)))
                used[dev.index] += 1
        out.append(_Stage(len(res.store.layers) - 1, devs[plan.head_device], None))
        return out

    def evaluate(self, inputs: StepInputs) -> EvalResult:
        """The batch's loss; returns once every device is idle again (the next step may reuse the
        slots at once)."""
        t0 = time.perf_counter()
        shells = [d.shell for d in self.res.devices]
        modes = [sh.dropout for sh in shells]
        out: dict[str, object] = {}
        first = self.res.devices[self.plan.embed_device]

        def work() -> None:
            try:
                if first.backend.is_cuda:
                    torch.cuda.set_device(first.device)
                with torch.no_grad():
                    out["loss_sum"] = self._run(inputs)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                out["error"] = exc

        for sh in shells:
            sh.set_dropout(False)  # eval mode, no dropout: the model's own evaluation loss
        try:
            # on the first device's compute lane thread, where a step's compute runs: on a shared
            # 2-core CPU the caller's thread took 3-15 s per 4 x 128-token batch, the lane 1.9 s
            self.res.workers.submit(first.compute_lane, work).wait()
        finally:
            for sh, mode in zip(shells, modes):
                sh.set_dropout(mode)  # training mode again where the engine trains with dropout
            for d in self.res.devices:
                d.backend.synchronize()
            tier = self.res.optimizer.tier
            if tier is not None:  # the evaluation's SSD reads are no part of the next step's trace
                tier.off.ssd.stats.take_records()
        if "error" in out:
            raise out["error"]  # type: ignore[misc]
        loss_sum = float(out["loss_sum"])  # type: ignore[arg-type]
        return EvalResult(loss_sum / inputs.denom, int(inputs.denom), time.perf_counter() - t0)

    def _run(self, inputs: StepInputs) -> float:
        stages = self.stages
        # the stage that last used each (device, slot): its compute must finish before a new upload
        prev: list[int | None] = []
        last: dict[tuple[int, int], int] = {}
        for i, st in enumerate(stages):
            key = (st.dev.index, st.slot) if st.slot is not None else None
            prev.append(last.get(key) if key is not None else None)
            if key is not None:
                last[key] = i
        ready: dict[int, object] = {}
        freed: dict[int, object] = {}
        issued = 0
        B = inputs.batch
        mb = max(1, self.plan.micro_batch_size)
        rows = [(lo, min(B, lo + mb)) for lo in range(0, B, mb)]
        hidden: list[torch.Tensor] = []
        calls: dict[int, list] = {}
        total = torch.zeros((), dtype=torch.float64)
        for i, st in enumerate(stages):
            # queue the uploads whose slot is free (its last user already computed), in order
            while issued < len(stages) and (issued == i or (issued > i and _free(prev[issued], i))):
                self._upload(stages[issued], prev[issued], ready, freed, issued)
                issued += 1
            dev = st.dev
            compute = dev.streams["compute"]
            if i > 0 and stages[i - 1].dev.index != dev.index:
                # the hidden states cross to another device entry (maybe the same GPU, another
                # stream): wait until the previous one has produced them
                stages[i - 1].dev.backend.sync_event(freed[i - 1])
            with dev.backend.use_stream(compute):
                dev.backend.wait_event(compute, ready.pop(i))
                if i == 0:
                    h, block_calls = self._embed(st, inputs)
                    calls[dev.index] = block_calls
                    hidden = [h[lo:hi] for lo, hi in rows]
                elif i == len(stages) - 1:
                    total = self._head(st, inputs, hidden, rows)
                else:
                    if dev.index not in calls:
                        src = calls[self.plan.embed_device]
                        calls[dev.index] = map_tensors(src, lambda t: t.to(dev.device, non_blocking=True))
                    hidden = self._block(st, hidden, rows, calls[dev.index], B)
                freed[i] = dev.backend.record_event(compute)
        return float(total)

    def _upload(self, st: _Stage, prev: int | None, ready: dict[int, object], freed: dict[int, object],
                i: int) -> None:
        dev = st.dev
        h2d = dev.streams["h2d"]
        with dev.backend.use_stream(h2d):
            if prev is not None:
                dev.backend.wait_event(h2d, freed.get(prev))
            dst = upload_destination(dev, st.layer, st.slot)
            upload_layer(self.res.store, self.res.optimizer, dev, st.layer, dst)
            ready[i] = dev.backend.record_event(h2d)

    def _bind(self, st: _Stage) -> None:
        """Point the shell's parameters of ``st.layer`` (and those it borrows) at its device buffer."""
        dev, spec = st.dev, self.res.store.layers[st.layer].spec
        flat = dev.pool.params(st.layer, st.slot)
        for p in spec.params:
            dev.shell.bind(p.name, flat[p.offset : p.offset + p.numel].view(p.shape))
        for name, owner in spec.borrowed:  # tied embeddings
            p = next(x for x in self.res.store.layers[owner].spec.params if x.name == name)
            dev.shell.bind(name, dev.pool.params(owner, None)[p.offset : p.offset + p.numel].view(p.shape))

    def _embed(self, st: _Stage, inputs: StepInputs) -> tuple[torch.Tensor, list]:
        self._bind(st)
        dev = st.dev
        ids = inputs.input_ids.to(dev.device, non_blocking=True)
        mask = inputs.attention_mask
        mask = mask.to(dev.device, non_blocking=True) if mask is not None else None
        pos = inputs.position_ids  # packed rows: positions restart per document, as in training
        pos = pos.to(dev.device, non_blocking=True) if pos is not None else None
        h, block_calls = dev.shell.embed_forward(ids, mask, pos)
        return h.to(self.res.compute_dtype), block_calls

    def _block(self, st: _Stage, hidden: list[torch.Tensor], rows: list[tuple[int, int]], calls: list,
               batch: int) -> list[torch.Tensor]:
        self._bind(st)
        dev = st.dev
        out = []
        for x, (lo, hi) in zip(hidden, rows):
            call = slice_rows(calls[st.layer - 1], lo, hi, batch)
            out.append(dev.shell.block_forward(st.layer - 1, x.to(dev.device, non_blocking=True), call))
        return out

    def _head(self, st: _Stage, inputs: StepInputs, hidden: list[torch.Tensor],
              rows: list[tuple[int, int]]) -> torch.Tensor:
        self._bind(st)
        dev = st.dev
        # half the training chunk, i.e. the chunk it had before the fused training head: its
        # F.cross_entropy over an fp32 copy holds ~10 B/logit (the training head ~3), so its peak
        # stays what it was rather than doubling
        chunk = max(1, self.res.head_chunk_tokens // 2)
        total = torch.zeros((), dtype=torch.float64, device=dev.device)
        for x, (lo, hi) in zip(hidden, rows):
            flat_x = x.to(dev.device, non_blocking=True).reshape(-1, x.shape[-1])
            host_y = inputs.shifted_labels[lo:hi].reshape(-1)
            flat_y = host_y.to(dev.device, non_blocking=True)
            for c0 in range(0, flat_x.shape[0], chunk):
                c1 = min(flat_x.shape[0], c0 + chunk)
                if not bool((host_y[c0:c1] != IGNORE).any()):  # decided on the host: no sync
                    continue
                logits = dev.shell.head_logits(flat_x[c0:c1])
                loss = F.cross_entropy(logits.float(), flat_y[c0:c1], ignore_index=IGNORE, reduction="sum")
                total += loss.double()
        return total.cpu()


def _free(prev: int | None, i: int) -> bool:
    """Whether a stage whose slot was last used by stage ``prev`` can be uploaded while stage ``i``
    is next to compute (its slot's last user has computed already)."""
    return prev is None or prev < i
