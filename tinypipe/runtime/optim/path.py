"""The engine's optimizer path, end to end, and its step counters.

Per step: :meth:`OptimizerPath.begin_step` starts the step's decisions; each layer's update task
hands its gradient stream to :meth:`OptimizerPath.consume` (decide on the norm, then step the
chunks as they land, or keep them for later); :meth:`OptimizerPath.finish_step` applies clipping
or rollback once the global norm is known, leaves what still has to be stepped on the host to the
background lane (it overlaps the next step; uploads wait per layer in :meth:`wait_layer`) and
queues the steps of the layers whose state lives on their device. :meth:`synchronize` makes the
host copy final. The engine's ``step_count`` and ``last_clipped`` change here only (a checkpoint
restores them through :meth:`OptimizerPath.restore_counters`); the per-layer step counts
(``LayerState.step``) change only in this package (:mod:`~tinypipe.runtime.optim.counters`). The
download task asks :meth:`OptimizerPath.download_route` where a gradient goes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from tinypipe.devices.host_buffers import aligned_empty, registrable
from tinypipe.distributed.shards import Shard
from tinypipe.memory.host_store import HostStore, LayerState
from tinypipe.runtime.optim.adamw import ChunkedAdamW
from tinypipe.runtime.optim.assist import AssistedUpdate, AssistedUpdates
from tinypipe.runtime.optim.background import BackgroundUpdates
from tinypipe.runtime.optim.counters import set_layer_step
from tinypipe.runtime.optim.decisions import StepDecisions, StepOutcome
from tinypipe.runtime.optim.device_state import DeviceOptimizerState
from tinypipe.runtime.optim.messages import GradEnd, GradNorm, GradStream
from tinypipe.runtime.signals import Abort
from tinypipe.runtime.optim.ssd_tier import SsdTier
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.workers import LaneWorkers
from tinypipe.schedule.tasks import Schedule


def retains_gradients(max_grad_norm: float | None, nonfinite: str) -> bool:
    """Whether each step keeps a full fp32 copy of every gradient on the host (4 B/param): to
    redo speculative steps with the clipped gradient, or to undo them after a non-finite one."""
    return max_grad_norm is not None or nonfinite == "skip"


@dataclass(frozen=True)
class DownloadRoute:
    """Where a layer's download sends its gradient after the norm, decided by the optimizer path:
    nowhere (``norm_only``: its state lives on its device), nowhere either but the layer is stepped
    on its device by the download (``round_trip``: an assisted layer whose master and moments
    travel instead), else to the host in chunks -- into ``keep``, the retained host copy, when
    there is one, else through the device's gradient pool."""

    norm_only: bool
    round_trip: bool
    keep: torch.Tensor | None


class OptimizerPath:
    """AdamW for every trainable layer: decisions, host steps, leftover work, device steps."""

    def __init__(self, store: HostStore, adamw: ChunkedAdamW, *, max_grad_norm: float | None, nonfinite: str,
                 device_states: dict[int, DeviceOptimizerState], pin: Callable[[torch.Tensor], None] | None,
                 threads: int | None, tier: SsdTier | None = None, assisted: tuple[int, ...] = (),
                 deferred: tuple[int, ...] = ()) -> None:
        self.store = store
        self.adamw = adamw
        self.max_grad_norm = max_grad_norm
        self.nonfinite = nonfinite
        self.device_states = device_states  # device index -> the layers stepped there
        self._owner = {layer: s for s in device_states.values() for layer in s.states}
        self.device_layers = frozenset(self._owner)
        retain = retains_gradients(max_grad_norm, nonfinite)
        self._retained: dict[int, torch.Tensor] | None = {} if retain else None
        self._pin = pin  # page-locks new retained buffers (gradients are downloaded straight into them)
        self.threads = threads  # OpenMP threads of the background lane (None: torch's default)
        self.background = BackgroundUpdates()  # the last step's leftover work (clipping)
        self.step_count = 0  # optimizer steps taken (a skipped step does not count)
        self.last_clipped = False  # a clipped step predicts another: the next one does not speculate
        self._step: StepDecisions | None = None
        self.tier = tier  # state on the SSD, staged around its uses (None: everything in DRAM)
        # Plan.assisted: with retained gradients every assisted update is leftover work; without
        # them (no clipping, nonfinite="raise") assisted layers are stepped on the device right
        # after their backward
        self.assist = None
        if assisted:
            self.assist = AssistedUpdates(store, adamw, assisted, self._retained_of, pin)
        self._assist_after_backward = self.assist is not None and not retain
        # Plan.deferred: always stepped in the background during the next step's forward; without
        # retained gradients each keeps its own page-locked gradient buffer for that
        self.deferred = frozenset(deferred)
        self._deferred_grads: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ one step

    def begin_step(self, lr: float, upload_order: dict[int, int]) -> None:
        """Start a step's decisions (``upload_order``: the schedule's, for the leftover work)."""
        # speculative layer steps are undone algebraically when the step turns out clipped (exact
        # enough: redone at once) or non-finite -- where "skip" promises the state bit for bit, so
        # under "skip" nothing is stepped before the whole backward has been checked
        speculate = not self.last_clipped and self.nonfinite != "skip"
        self._step = StepDecisions(self.store, self.adamw, lr, self.max_grad_norm, self._retained,
                                   speculate=speculate, device_layers=self.device_layers,
                                   upload_order=upload_order, deferred_layers=self.deferred,
                                   deferred_grads=self._deferred_grads)

    def start_staging(self, schedule: Schedule, abort: Abort, workers: LaneWorkers) -> None:
        """Start the step's reads of SSD-resident state (with a tier; after :meth:`begin_step`)."""
        if self.tier is not None:
            self.tier.begin_step(schedule, abort, workers, self.wait_layer, self.background.wait_done)

    def abandon_step(self, synchronize: Callable[[], None]) -> None:
        """A step failed: give back the SSD staging it held (``synchronize``: the devices)."""
        if self.tier is not None:
            self.tier.abandon_step(synchronize)

    def retain_buffer(self, layer: int) -> torch.Tensor | None:
        """The page-locked fp32 host copy of ``layer``'s gradient (None: not retaining, or frozen):
        a staging slot when the gradient lives on the SSD (waits for the slot)."""
        n = self.store.layers[layer].spec.train_numel
        bufs = self._retained if self._retained is not None else (
            self._deferred_grads if layer in self.deferred else None)
        if bufs is None or n == 0:  # nothing to retain for a frozen layer (LoRA)
            return None
        if self.tier is not None and self.store.offloaded(layer, "grad"):
            return self.tier.grad_buffer(layer)
        if layer not in bufs:
            buf = aligned_empty(n, torch.float32)
            if self._pin is not None:
                self._pin(registrable(buf))  # gradients are downloaded straight into it
            bufs[layer] = buf
        return bufs[layer]

    def consume(self, layer: int, stream: GradStream, abort: Abort,
                loss_finite: Callable[[], bool] | None = None) -> None:
        """``layer``'s update: decide on its norm, then step each gradient chunk as it lands.

        ``loss_finite`` (the head's update, which runs first) is asked once the norm is on the
        host; a non-finite loss skips the whole step."""
        dec = self._current()
        first = stream.get(abort)
        assert isinstance(first, GradNorm), first
        if self.assist is not None and not self._assist_after_backward:
            # the last step's assisted update (run at this step's upload, which the gradient came
            # after) has landed on the host. After the backward nothing is to settle here: this
            # step's upload settled the last step's, and waiting for this step's own round trip
            # would hold the host's other updates behind the link
            self.assist.settle(layer)
        first.backend.sync_event(first.event)
        norm = float(first.norm.item())
        decision = dec.decide(layer, norm**2, True if loss_finite is None else loss_finite())
        state = self.store.layers[layer]
        step_no = state.step + 1
        if self.steps_after_backward(layer):  # the download stepped it already: nothing comes but the end
            assert decision in ("step", "skip"), decision
            assert isinstance(stream.get(abort), GradEnd)
            if decision == "skip" and math.isfinite(norm):  # a finite gradient the device did apply
                dec.stepped.append(layer)  # (a non-finite step then reports it as kept)
                decision = "step"
            if decision == "step":
                set_layer_step(state, step_no)
            return
        staged = self.tier.for_update(layer) if self.tier is not None else None
        if staged is not None:  # state on the SSD: step the staging buffers instead
            self._consume_chunks(layer, stream, abort, decision, staged.state, step_no, dec.lr,
                                 staged.grad if staged.grad is not None else self.retain_buffer(layer))
            self.tier.finish_update(layer, staged, decision)  # type: ignore[union-attr]
        else:
            keep = self.retain_buffer(layer) if decision != "device" else None  # holds the chunks already
            self._consume_chunks(layer, stream, abort, decision, state, step_no, dec.lr, keep)
        if decision == "step":
            set_layer_step(state, step_no)

    def _consume_chunks(self, layer: int, stream: GradStream, abort: Abort, decision: str, state: LayerState,
                        step_no: int, lr: float, keep: torch.Tensor | None) -> None:
        """Step (or just take) each gradient chunk of ``layer`` as it lands."""
        while True:
            chunk = stream.get(abort)
            if isinstance(chunk, GradEnd):
                break
            assert not isinstance(chunk, GradNorm), chunk
            chunk.backend.sync_event(chunk.event)
            grad = keep[chunk.lo : chunk.hi] if chunk.buffer is None else chunk.buffer[: chunk.hi - chunk.lo]
            if decision == "step":
                self.adamw.step(state, chunk.lo, chunk.hi, grad, step_no, lr)
            if chunk.buffer is not None:
                chunk.pool.release(chunk.buffer)

    def finish_step(self, workers: LaneWorkers) -> StepOutcome:
        """Close the step once every update has run: clip or roll back, start the leftover host
        work in the background, queue the device steps, count the step."""
        dec = self._current()
        self.background.wait_all()  # every layer was uploaded, so the last step's leftovers are done
        if self.assist is not None and not self._assist_after_backward:  # (after the backward: the
            self.assist.drain()  # next upload of each layer, or synchronize, waits for its trip)
        if self.tier is not None:
            self.tier.end_step()
        ran = list(self.background.timings)
        outcome = dec.finalize()
        outcome.background_timings = ran
        work = dec.work if self.tier is None else self.tier.background(dec.work, dec.staged)
        work = self.leftover(work, dec)
        if self.assist is not None:  # the assisted layers' updates wait for their next upload instead
            work = self.assist.take(work, dec.deferred_steps, dec.lr)
        # what still has to wait for the global norm runs while the next step starts (its uploads
        # wait per layer); synchronize() waits for all of it
        self.background.start(work, workers, self.threads)
        for state in self.device_states.values():  # device order, then the decisions' order
            for layer, step in dec.device_steps:
                if state.owns(layer):
                    state.step(layer, self.adamw, outcome.clip_coef, step, dec.lr)
        self.last_clipped = outcome.clipped
        self.step_count += 0 if outcome.skipped else 1
        self._step = None
        return outcome

    def leftover(self, work: list[tuple[int, Callable[[], None]]],
                 dec: StepDecisions) -> list[tuple[int, Callable[[], None]]]:
        """The background work of the step ``dec`` closes (a sharded path adds its all-gathers)."""
        return work

    def shard(self, layer: int) -> Shard | None:
        """The part of ``layer``'s gradient this rank steps (None: all of it)."""
        return None

    def _current(self) -> StepDecisions:
        if self._step is None:
            raise RuntimeError("no optimizer step in progress (begin_step first)")
        return self._step

    # ------------------------------------------------------------------ layers stepped on their device

    def on_device(self, layer: int) -> bool:
        """Whether ``layer``'s AdamW state lives on its device (only its norm leaves it)."""
        return layer in self._owner

    def load_on_device(self, layer: int, params: torch.Tensor) -> bool:
        """Load ``layer``'s device state (first upload, or after :meth:`synchronize`); whether it
        copied anything (see :meth:`DeviceOptimizerState.load`)."""
        return self._owner[layer].load(layer, params)

    # ------------------------------------------------------------------ between steps

    def wait_layer(self, layer: int, abort: Abort | None = None) -> None:
        """Block until the last step's leftover update of ``layer`` is applied."""
        self.background.wait_layer(layer, abort)
        if self.assist is not None:
            self.assist.settle(layer)

    def steps_after_backward(self, layer: int) -> bool:
        """Whether ``layer``'s download steps it on the device (an assisted layer in a run whose
        updates never wait for the global norm) instead of sending its gradient to the host."""
        return self._assist_after_backward and layer in self.assist.layers  # type: ignore[union-attr]

    def download_route(self, layer: int) -> DownloadRoute:
        """How ``layer``'s download sends its gradient (:class:`DownloadRoute`). The retained buffer
        (clipping / skip) is created here, by the download, before the norm tells the update task
        to look for it: created by both lanes at once, the chunks would land in the other one."""
        on_device = self.on_device(layer)
        round_trip = self.store.layers[layer].spec.train_numel > 0 and self.steps_after_backward(layer)
        keep = None if on_device else self.retain_buffer(layer)
        return DownloadRoute(norm_only=on_device, round_trip=round_trip, keep=keep)

    def step_on_download(self, layer: int, dev: DeviceRuntime, grad: torch.Tensor,
                         norm: torch.Tensor) -> None:
        """Step ``layer`` on ``dev`` right after its backward (:attr:`DownloadRoute.round_trip`);
        its count moves when its update task sees the decision (:meth:`consume`)."""
        assert self.assist is not None, "a round trip without assisted layers"
        step = self.store.layers[layer].step + 1  # this step's update of the layer has not run yet
        self.assist.step_after_backward(layer, dev, grad, norm, step, self.step_lr())

    def restore_counters(self, step_count: int, last_clipped: bool) -> None:
        """Set the engine's step count and whether the last step clipped to a checkpoint's (the
        per-layer counts were restored with the layers' state, :func:`~.counters.set_layer_step`)."""
        self.step_count = step_count
        self.last_clipped = last_clipped

    def step_lr(self) -> float:
        """The learning rate of the step in progress."""
        return self._current().lr

    def claim_assisted(self, layer: int) -> AssistedUpdate | None:
        """``layer``'s leftover update for its upload to run on the device (None: it has none;
        :class:`~tinypipe.runtime.optim.assist.AssistedUpdates`)."""
        return None if self.assist is None else self.assist.claim(layer)

    @property
    def failed(self) -> bool:
        """Whether leftover work failed (the next wait raises its error)."""
        return self.background.error is not None

    def wait_background(self) -> None:
        """Block until the leftover work is done; raise if it failed."""
        self.background.wait_all()

    def synchronize(self) -> None:
        """Make the host copy of every weight and moment final (leftover work done, device state
        copied back; the next step reloads it, with any change made on the host)."""
        self.background.wait_all()
        if self.assist is not None:
            self.assist.drain()
        for state in self.device_states.values():
            state.store()
            state.invalidate()
        if self.tier is not None:
            self.tier.flush()  # every write-back landed (or its failure is raised)

    # ------------------------------------------------------------------ memory

    def _retained_of(self, layer: int) -> torch.Tensor | None:
        return None if self._retained is None else self._retained.get(layer)

    @property
    def retained_bytes(self) -> int:
        """Host gradient copies: every layer's when retaining, else the deferred layers'."""
        kept = list((self._retained or {}).values()) + list(self._deferred_grads.values())
        return sum(t.numel() * 4 for t in kept)

    def device_state_bytes(self, device: int) -> int | None:
        """Bytes of AdamW state on ``device`` (None: it steps no layer)."""
        state = self.device_states.get(device)
        return None if state is None else state.nbytes
