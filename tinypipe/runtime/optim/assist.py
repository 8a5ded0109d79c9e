"""Assisted updates: the AdamW updates of some host-stepped layers run on their device.

When global-norm clipping triggers (or a step does not speculate), every host-stepped layer's
update waits for the global norm and runs after the backward, on the host, in the next step's
upload order; each upload of the next forward waits for its layer's update
(:mod:`tinypipe.runtime.optim.background`). Meanwhile the link idles, and the host pass bounds the
step: with 16 cores a clipped step ran 0.78-0.87x its unclipped speed (docs/measured.md).

For the layers in ``Plan.assisted`` the host skips that update. The layer's first upload of the
next step does it instead (:meth:`AssistedUpdates.run`): chunk by chunk, the fp32 master, both
moments and the retained gradient go up (16 B/param instead of the 4 B/param master upload),
the same fused AdamW steps them on the device, the result is cast into the layer's slot -- so
this is also the layer's weight upload -- and master and moments come back on the d2h stream
(12 B/param), which the forward leaves idle. Host pass and link then share the work; the planner
chooses the layers (:mod:`tinypipe.planner.assist`).

Without clipping (and ``nonfinite="raise"``) no update waits for the norm, and the host AdamW
running beside the backward is what bounds the step of a large model (its backward phase can take
nearly twice its compute, docs/measured.md). There an assisted layer is stepped
on the device right after its backward (:meth:`AssistedUpdates.step_after_backward`): master and
moments go up (12 B/param) and come back (12 B/param, instead of its 4 B/param fp32 gradient),
and the host steps only the other layers.

The host copy of an assisted layer is final once its download has landed: :meth:`settle` waits
for it, and everything that reads the host copy (a later upload, the layer's next host step,
``synchronize``) goes through :meth:`OptimizerPath.wait_layer` or settles first. An update no
upload claims (the run stops between steps) is run on the host by :meth:`drain`, so the host copy
never depends on a next step happening. The values equal the host pass's: the same fused AdamW on
the same fp32 inputs, elementwise -- bit-identical on CPU while chunks are whole multiples of the
kernel's vector width (:data:`~tinypipe.memory.device_pool.ASSIST_CHUNK_NUMEL` is; a run split at
an unaligned offset rounds its scalar tail differently, within float rounding). On CUDA the
device kernel may differ from the CPU kernel by float rounding.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tinypipe.devices.host_buffers import registrable
from tinypipe.memory.device_pool import ASSIST_CHUNK_NUMEL
from tinypipe.memory.host_store import HostStore, SliceState
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.optim.adamw import ChunkedAdamW


@dataclass(frozen=True)
class AssistedUpdate:
    """One layer's leftover update: AdamW step ``step`` with its gradient times ``coef`` at ``lr``;
    ``on_host`` does the same on the host (when no upload claims it)."""

    layer: int
    coef: float
    step: int
    lr: float
    on_host: Callable[[], None]


class _Ring:
    """A device's chunk buffers, reused in turn; each free once its last download has landed."""

    def __init__(self, count: int) -> None:
        self.free: list[object | None] = [None] * count  # the event of each buffer's last download
        self.next = 0

    def take(self) -> tuple[int, object | None]:
        k = self.next
        self.next = (k + 1) % len(self.free)
        return k, self.free[k]


class AssistedUpdates:
    """The pending and in-flight assisted updates of one engine (see the module docstring)."""

    def __init__(self, store: HostStore, adamw: ChunkedAdamW, layers: Sequence[int],
                 gradient: Callable[[int], torch.Tensor | None],
                 pin: Callable[[torch.Tensor], None] | None) -> None:
        self.store = store
        self.adamw = adamw
        self.layers = frozenset(layers)
        self._gradient = gradient  # layer -> its retained fp32 gradient on the host
        self._pending: dict[int, AssistedUpdate] = {}
        self._landing: dict[int, tuple[DeviceRuntime, object | None]] = {}  # layer -> its last download
        self._rings: dict[int, _Ring] = {}  # device index -> its chunk buffers
        self._lock = threading.Lock()
        self._moved = [0, 0]  # bytes up, down beyond the schedule's master upload, since moved() was read
        if pin is not None:  # master and retained gradient are page-locked already; the moments too
            for layer in sorted(self.layers):
                state = store.layers[layer]
                if state.spec.train_numel:
                    pin(registrable(state.exp_avg))
                    pin(registrable(state.exp_avg_sq))

    # ------------------------------------------------------------------ the end of a step

    def take(self, work: list[tuple[int, Callable[[], None]]],
             deferred: dict[int, tuple[float, int]], lr: float) -> list[tuple[int, Callable[[], None]]]:
        """Move the assisted layers' plain deferred updates (``deferred``: layer -> (clip coefficient,
        step number); not a redo of a speculative step) out of the host's leftover ``work``; return
        the rest. Call after :meth:`drain`."""
        rest = []
        with self._lock:
            for layer, fn in work:
                if layer in self.layers and layer in deferred and self.store.layers[layer].spec.train_numel:
                    coef, step = deferred[layer]
                    self._pending[layer] = AssistedUpdate(layer, coef, step, lr, fn)
                else:
                    rest.append((layer, fn))
        return rest

    @property
    def pending(self) -> frozenset[int]:
        """Layers whose update no upload has claimed yet."""
        with self._lock:
            return frozenset(self._pending)

    # ------------------------------------------------------------------ the next step's uploads

    def claim(self, layer: int) -> AssistedUpdate | None:
        """``layer``'s pending update, now the caller's to run (None: there is none)."""
        with self._lock:
            return self._pending.pop(layer, None)

    def run(self, item: AssistedUpdate, dev: DeviceRuntime, dst: torch.Tensor) -> None:
        """Step ``item`` on ``dev`` and leave the result in ``dst`` (the layer's slot or resident
        buffer, compute precision): per chunk, upload (the retained gradient too) and step on the
        h2d stream, download on the d2h stream once stepped. Queued only; :meth:`settle` waits for
        the host copy."""
        state = self.store.layers[item.layer]
        grad = self._gradient(item.layer)
        assert grad is not None, f"layer {item.layer}: an assisted update needs its retained gradient"
        n = state.spec.train_numel
        h2d = dev.streams["h2d"]
        with dev.backend.use_stream(h2d):
            scale = None
            if item.coef != 1.0:  # as the host pass: the kernel divides the gradient by 1 / coef
                scale = torch.full((), 1.0 / item.coef, dtype=torch.float32, device=dev.device)
            # beyond the master upload every layer makes anyway: the gradient (+ moments) up
            self._round_trip(item.layer, dev, h2d, h2d, item.step, item.lr, host_grad=grad, dst=dst,
                             grad_scale=scale, extra=(4 * n * (3 if item.step > 1 else 1), 12 * n))
            if state.frozen is not None:  # frozen weights (LoRA): the plain copy after the prefix
                dst[n : n + state.frozen.numel()].copy_(state.frozen, non_blocking=True)

    def _round_trip(self, layer: int, dev: DeviceRuntime, up: object, on: object, step: int, lr: float, *,
                    extra: tuple[int, int], host_grad: torch.Tensor | None = None,
                    device_grad: torch.Tensor | None = None, dst: torch.Tensor | None = None,
                    grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
        """Chunk by chunk: ``layer``'s master and moments (and ``host_grad``) up on stream ``up``,
        AdamW step ``step`` on stream ``on`` (with ``device_grad`` when the gradient is on the
        device; the result cast into ``dst`` if given), master and moments back on d2h; the chunk
        buffers are reused once their download has landed. ``extra``: the link bytes (up, down) the
        step's traffic adds."""
        state = self.store.layers[layer]
        n = state.spec.train_numel
        be = dev.backend
        d2h = dev.streams["d2h"]
        bufs = dev.pool.assist
        ring = self._rings.setdefault(dev.index, _Ring(len(bufs)))
        last = None
        for lo in range(0, n, ASSIST_CHUNK_NUMEL):
            hi = min(n, lo + ASSIST_CHUNK_NUMEL)
            k, free = ring.take()
            be.wait_event(up, free)  # the buffer's previous chunk has gone back down
            p, m, v, g = (row[: hi - lo] for row in bufs[k])
            with be.use_stream(up):
                p.copy_(state.master[lo:hi], non_blocking=True)
                if step > 1:  # a first step zeroes the moments (ChunkedAdamW.step)
                    m.copy_(state.exp_avg[lo:hi], non_blocking=True)
                    v.copy_(state.exp_avg_sq[lo:hi], non_blocking=True)
                if host_grad is not None:
                    g.copy_(host_grad[lo:hi], non_blocking=True)
                uploaded = be.record_event(up)
            be.wait_event(on, uploaded)
            with be.use_stream(on):
                grad = g if device_grad is None else device_grad[lo:hi]
                chunk = SliceState(state.spec, master=p, exp_avg=m, exp_avg_sq=v, base=lo)
                self.adamw.step(chunk, 0, hi - lo, grad, step, lr, grad_scale=grad_scale, found_inf=found_inf)
                if dst is not None:
                    dst[lo:hi].copy_(p)
                stepped = be.record_event(on)
            be.wait_event(d2h, stepped)
            with be.use_stream(d2h):
                state.master[lo:hi].copy_(p, non_blocking=True)
                state.exp_avg[lo:hi].copy_(m, non_blocking=True)
                state.exp_avg_sq[lo:hi].copy_(v, non_blocking=True)
                last = ring.free[k] = be.record_event(d2h)
        with self._lock:
            self._landing[layer] = (dev, last)
            if be.is_cuda:  # as step traffic: CPU "devices" move nothing
                self._moved[0] += extra[0]
                self._moved[1] += extra[1]

    def moved(self) -> tuple[int, int]:
        """Bytes the assisted updates moved up and down (beyond the master upload every layer
        makes anyway) since the last call: the step's link traffic adds them."""
        with self._lock:
            up, down = self._moved
            self._moved = [0, 0]
        return up, down

    # ------------------------------------------------------------------ right after the backward

    def step_after_backward(self, layer: int, dev: DeviceRuntime, grad: torch.Tensor, norm: torch.Tensor,
                            step: int, lr: float) -> None:
        """Step ``layer`` on ``dev`` with its accumulated gradient ``grad`` (the device's fp32
        accumulator, whose download this replaces) -- a step that does not wait for the global
        norm. Called on the d2h lane, stream d2h current: per chunk, master and moments go up on the
        device's (otherwise idle) collective stream, are stepped and come back on d2h, so the d2h
        lane's signal covers the gradient's last read. ``norm`` (this layer's, on the device) gates
        the kernel: a non-finite gradient leaves the layer as it was, as the host would."""
        n = self.store.layers[layer].spec.train_numel
        found_inf = (~torch.isfinite(norm)).to(torch.float32)
        # master (+ moments) up, with no master upload beside it; master and moments down instead
        # of the fp32 gradient
        self._round_trip(layer, dev, dev.streams["collective"], dev.streams["d2h"], step, lr,
                         device_grad=grad, found_inf=found_inf, extra=(4 * n * (3 if step > 1 else 1), 8 * n))

    # ------------------------------------------------------------------ readers of the host copy

    def settle(self, layer: int) -> None:
        """Block until ``layer``'s host copy holds its assisted update (if it had one in flight);
        an update still pending runs on the host here."""
        item = self.claim(layer)
        if item is not None:
            item.on_host()
            return
        with self._lock:
            landing = self._landing.pop(layer, None)
        if landing is not None:
            dev, event = landing
            dev.backend.sync_event(event)

    def drain(self) -> None:
        """Make every host copy final: run unclaimed updates on the host, wait for the downloads."""
        with self._lock:
            layers = sorted(set(self._pending) | set(self._landing))
        for layer in layers:
            self.settle(layer)
