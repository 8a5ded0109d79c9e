"""The Engine: a Hugging Face causal LM trained through Tiny-Pipe swapping on 1..N devices."""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from tinypipe.config import Config
from tinypipe.devices.backend import HostPinner, make_backend
from tinypipe.errors import ConfigError, NonFiniteError, PlanDoesNotFitError, WorkerError, WriteError
from tinypipe.lora.hooks import save_adapter, split_peft
from tinypipe.memory.budget import check_host_memory
from tinypipe.memory.device_pool import DevicePool
from tinypipe.memory.grad_pool import HostGradPool, buffer_count, chunk_numel
from tinypipe.memory.host_buffers import aligned_empty, registrable
from tinypipe.memory.host_store import IN_PLACE_MARK, HostStore
from tinypipe.models.compiled import resolve_backend
from tinypipe.models.decompose import Decomposition, Shell
from tinypipe.models.export import save_hf_directory
from tinypipe.models.head import chunk_tokens_for
from tinypipe.planner.auto import configure
from tinypipe.runtime.checkpoint import load_checkpoint, save_checkpoint
from tinypipe.runtime.deferred import LANE as DEFERRED_LANE
from tinypipe.runtime.deferred import DeferredUpdates
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.device_optimizer import DeviceAdamW
from tinypipe.runtime.inputs import prepare_inputs
from tinypipe.runtime.observability import EngineObservability
from tinypipe.runtime.optimizer import CpuAdamW
from tinypipe.runtime.step import StepRunner, StepState, TaskTiming
from tinypipe.runtime.traffic import Traffic, step_traffic
from tinypipe.runtime.updater import StepUpdater
from tinypipe.runtime.workers import LaneWorkers
from tinypipe.schedule.builder import build_schedule
from tinypipe.schedule.plan import Plan, make_plan
from tinypipe.schedule.tasks import Schedule, Task
from tinypipe.schedule.validate import validate

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_ENGINE_KEY = "_tinypipe_engine"  # the engine's own state inside a checkpoint's extra
STAGING_MAX = 32 * 1024 * 1024  # elements: the fp32 upload staging buffer (128 MiB) -- chunks larger layers


@dataclass
class StepResult:
    """What one optimizer step did."""

    loss: float
    grad_norm: float
    clipped: bool
    skipped: bool
    tokens: int
    seconds: float
    step: int
    lr: float
    timings: list = field(default_factory=list, repr=False)
    h2d_bytes: int = 0  # host -> device traffic of the step (weights, stashed activations)
    d2h_bytes: int = 0  # device -> host (gradients, stashed activations)
    device_peak_allocated: int = 0  # the fullest device's allocator peaks during the step (0 on CPU)
    device_peak_reserved: int = 0


def _prefer_expandable_segments() -> None:
    """Use expandable allocator segments unless the user configured the allocator.

    Activations of varying sizes otherwise fragment fixed segments: measured on W1, 7.5 GiB
    allocated needed 12.2 GiB reserved.
    """
    if "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return
    try:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except Exception:  # noqa: BLE001 - an allocator without the option: keep its default
        pass


def _stop(deferred: DeferredUpdates, workers: LaneWorkers) -> None:
    """Finish background optimizer work, then stop the lane threads (engine finalizer)."""
    deferred.wait_quietly()
    workers.shutdown(0.0)


class Engine(EngineObservability):
    """Trains ``model`` (a Hugging Face causal LM) with Tiny-Pipe's layer-wise swapping.

    The model's parameters move into the engine's host store (one fp32 copy; the model's
    parameters become views of it). Every :meth:`step` streams layers through the configured
    devices and steps AdamW on the host, overlapped with the backward pass.

    With no packing knob set in ``config`` the planner chooses them (``engine.config`` holds the
    choice, ``engine.plan_result`` the planner's answer; see :class:`tinypipe.Config`).
    """

    def __init__(self, model: nn.Module, config: Config | None = None, plan: Plan | None = None) -> None:
        # unset packing knobs: the planner picks them (or refuses: PlanDoesNotFitError, one line)
        self.config, self.plan_result = configure(model, config or Config(), plan_given=plan is not None)
        cfg = self.config
        # a peft.PeftModel (LoRA): train its inner model; frozen base weights stay at compute precision
        self.peft_model, model = split_peft(model)
        self.model = model
        self.backends = [make_backend(d) for d in cfg.devices]
        self.dtype = _DTYPES[cfg.precision]
        self.decomposition = Decomposition(model)
        dec = self.decomposition
        self.plan = plan or make_plan(
            dec.num_blocks,
            pack_size=cfg.pack_size,
            fwd_micro_batch=cfg.micro_batch_size,
            bwd_micro_batch=cfg.bwd_micro_batch_size,
            num_devices=len(cfg.devices),
            prefetch_window=cfg.prefetch_window,
            stash=cfg.stash,
            tied=dec.tied,
            grad_slots=cfg.grad_slots,
            device_optimizer=cfg.device_optimizer or "off",
            resident_packs=cfg.resident_packs or 0,
        )
        if self.plan.num_devices != len(cfg.devices):
            raise ConfigError(f"plan is for {self.plan.num_devices} devices, config lists {len(cfg.devices)}")
        if self.plan.num_blocks != dec.num_blocks:
            raise ConfigError(f"plan covers {self.plan.num_blocks} blocks, the model has {dec.num_blocks}")
        any_cuda = any(b.is_cuda for b in self.backends)
        self.pinner = HostPinner(enabled=any_cuda and cfg.pin_memory == "register")
        retain = cfg.max_grad_norm is not None or cfg.nonfinite == "skip"
        n_params = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # what the store still allocates: AdamW moments, the fp32 master unless a loader already
        # placed it (tinypipe.load_model), the retained gradient, frozen weights at compute precision
        per = 8 + (0 if model.__dict__.get(IN_PLACE_MARK) else 4) + (4 if retain else 0)
        need = per * trainable + sum(s.frozen_numel for s in dec.layers) * self.dtype.itemsize  # QLoRA: exact
        check_host_memory(need, f"the training state of {n_params / 1e6:.1f} M parameters")
        try:
            self.store = HostStore(model, dec, self.pinner, frozen_dtype=self.dtype)
        except (MemoryError, RuntimeError) as exc:
            if isinstance(exc, RuntimeError) and "allocate" not in str(exc):
                raise
            raise PlanDoesNotFitError(f"host memory: cannot allocate the training state of {n_params / 1e6:.1f} M "
                                      f"parameters ({' '.join(str(exc).split())[:200]})") from exc
        self.hidden_size = int(model.config.hidden_size)
        self.head_chunk = cfg.head_chunk_tokens or chunk_tokens_for(int(model.config.vocab_size))
        slot_numel = max(layer.numel for layer in dec.blocks)
        grad_numel = max(layer.train_numel for layer in dec.blocks)  # frozen parameters: no gradients
        grad_chunk = chunk_numel(max(1, grad_numel))
        compile_backend = resolve_backend(cfg.compile_blocks, any(b.is_cuda for b in self.backends))
        if compile_backend is not None and compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise ConfigError(f"compile_blocks: unknown torch.compile backend {compile_backend!r}")
        self.compile_backend = compile_backend
        self.devices: list[DeviceRuntime] = []
        for i, backend in enumerate(self.backends):
            has_packs = i in self.plan.fwd_device or i in self.plan.bwd_device
            resident, resident_grad = {}, {}
            if i == self.plan.embed_device:
                resident[0], resident_grad[0] = dec.embed.numel, dec.embed.train_numel
            if i == self.plan.head_device:
                resident[dec.num_blocks + 1], resident_grad[dec.num_blocks + 1] = dec.head.numel, dec.head.train_numel
            for layer in self.plan.resident_layers(i):  # resident packs: never swapped, stepped here
                resident[layer], resident_grad[layer] = dec.blocks[layer - 1].numel, dec.blocks[layer - 1].train_numel
            try:
                pool = DevicePool(
                    backend,
                    self.dtype,
                    slot_numel,
                    self.plan.param_slots() if has_packs else 0,
                    self.plan.grad_slot_count() if has_packs else 0,
                    resident,
                    staging_numel=min(slot_numel, STAGING_MAX),
                    grad_numel=grad_numel,
                    resident_grad=resident_grad,
                )
                owned = self.plan.device_optimized(i)
                optim = DeviceAdamW(backend, {layer: self.store.layers[layer] for layer in owned}) if owned else None
            except torch.OutOfMemoryError as exc:
                raise PlanDoesNotFitError(
                    f"device {cfg.devices[i]}: out of memory for its layer slots and resident layers "
                    f"({' '.join(str(exc).split())[:160]}); lower pack_size or the micro-batch, use more devices, "
                    "or run `tinypipe plan` to see what fits") from exc
            # retained gradients (clipping, non-finite skip) are downloaded straight into their
            # page-locked host buffers: the staging pool would be an extra 4 B/param copy per step
            pool_buffers = 0 if retain else buffer_count(max(1, grad_numel), cfg.host_grad_buffers)
            gpool = HostGradPool(pool_buffers, grad_chunk, self.pinner)
            shell = Shell(model, dec, backend.device)
            if compile_backend is not None:
                shell.compile_blocks(compile_backend)
            self.devices.append(DeviceRuntime(i, cfg.devices[i], backend, shell, pool, gpool, optim=optim))
        self.optimizer = CpuAdamW(cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay)
        self._retained: dict[int, torch.Tensor] | None = {} if retain else None
        self._schedules: dict[int, Schedule] = {}
        self._broken: str | None = None
        self._host_stash: dict[int, torch.Tensor] = {}
        self._last_state: StepState | None = None
        self._last_origin = 0.0
        self._traffic_cache: dict[tuple[int, int], Traffic] = {}
        self._last_clipped = False  # a clipped step predicts another: the next one does not speculate
        self.step_count = 0
        self.fault: Callable[[Task], None] | None = None  # test hook: called before every task
        self._rss_peak = 0
        self._prefetch_pool: dict = {}
        self._workers = LaneWorkers()  # one persistent thread per lane, reused by every step
        self._deferred = DeferredUpdates()  # the last step's leftover optimizer work (clipping)
        # an engine dropped (or alive at interpreter exit) with a background update still running:
        # finish it first -- torch kernels running in a thread while the interpreter tears down
        # abort the process ("terminate called without an active exception")
        weakref.finalize(self, _stop, self._deferred, self._workers)
        cores = os.cpu_count() or 1
        # leave cores for the lanes that feed the GPUs; an OpenMP team sharing a core with a busy
        # lane runs at the straggler's pace
        self._optimizer_threads = cfg.optimizer_threads or (max(1, cores - 1 - len(self.devices)) if any_cuda else None)
        if any_cuda:
            _prefer_expandable_segments()
        validate(build_schedule(self.plan, 1, dec.tied))  # an unschedulable plan fails here, not at step 1

    # ------------------------------------------------------------------ training

    def schedule_for(self, batch: int) -> Schedule:
        """The (validated) schedule for a global batch of ``batch`` sequences."""
        if batch not in self._schedules:
            sched = build_schedule(self.plan, batch, self.decomposition.tied)
            validate(sched)
            self._schedules[batch] = sched
        return self._schedules[batch]

    def _prepare_host_stash(self, B: int, S: int) -> None:
        shape = (B, S, self.hidden_size)
        for q, on_host in enumerate(self.plan.stash_on_host):
            if not on_host or q == 0:
                continue
            t = self._host_stash.get(q)
            if t is None or t.shape != shape:
                flat = aligned_empty(B * S * self.hidden_size, self.dtype)
                self.pinner.pin(registrable(flat))
                self._host_stash[q] = flat.view(shape)

    def step(self, batch: Mapping[str, torch.Tensor], lr: float | None = None) -> StepResult:
        """One optimizer step over the global ``batch`` (dict with input_ids, optional
        attention_mask and labels; labels default to input_ids with padding ignored)."""
        if self._broken is not None:
            raise WorkerError(f"engine unusable: {self._broken}; create a new Engine (from the last checkpoint)")
        if self._deferred.error is not None:
            self._broken = "the last step's optimizer update failed"
            self._deferred.wait_all()  # raises the cause
        t0 = time.perf_counter()
        max_pos = getattr(self.model.config, "max_position_embeddings", None)
        inputs = prepare_inputs(batch, int(self.model.config.vocab_size), None if max_pos is None else int(max_pos),
                                pin=any(b.is_cuda for b in self.backends))
        sched = self.schedule_for(inputs.batch)
        self._prepare_host_stash(inputs.batch, inputs.seq)
        lr = self.config.lr if lr is None else float(lr)
        # speculative layer steps are undone algebraically when the step turns out clipped (exact
        # enough: redone at once) or non-finite -- where "skip" promises the state bit for bit, so
        # under "skip" nothing is stepped before the whole backward has been checked
        speculate = not self._last_clipped and self.config.nonfinite != "skip"
        updater = StepUpdater(self.store, self.optimizer, lr, self.config.max_grad_norm, self._retained,
                              speculate=speculate, device_layers=self._device_layers(),
                              pin=self.pinner.pin, upload_order=sched.upload_order())
        for d in self.devices:
            d.backend.reset_peak()
            d.grad_pool.reset()
        runner = StepRunner(
            sched, inputs, self.devices, self.store, updater, self.dtype, self.hidden_size,
            self.head_chunk, self._host_stash, self.config.trace, self.fault,
            stall_timeout=self.config.stall_timeout_s, check_finite=self.config.check_finite,
            optimizer_threads=self._optimizer_threads, prefetch_pool=self._prefetch_pool,
            workers=self._workers, deferred=self._deferred,
        )
        self._last_origin = t0
        try:
            state = runner.run()
        except WorkerError as exc:
            self._workers.shutdown()  # no lane thread outlives a failed step (a stuck one is abandoned)
            if runner.stuck:
                self._broken = f"a worker is still stuck in {runner.stuck}"
            if self._deferred.error is not None:  # the last step's update failed under this one
                self._broken = "the last step's optimizer update failed"
            if isinstance(exc.__cause__, NonFiniteError):  # check_finite located a NaN/inf
                raise NonFiniteError(str(exc.__cause__)) from exc
            raise
        self._deferred.wait_all()  # every layer was uploaded, so the last step's leftovers are done
        state.timings[:0] = [TaskTiming(DEFERRED_LANE, f"upd/L{layer} (last step's, clipped)", t0, t1)
                             for layer, t0, t1 in self._deferred.timings]  # in this step's timeline
        outcome = updater.finalize()
        # what still has to wait for the global norm runs while the next step starts (its uploads
        # wait per layer); Engine.synchronize() waits for all of it
        self._deferred.start(updater.work, self._workers, self._optimizer_threads)
        self._step_on_devices(updater, outcome.clip_coef, lr)
        self._last_clipped = outcome.clipped
        self._last_state = state
        self._sample_rss()
        loss = state.loss_value if state.loss_value is not None else float("nan")
        self.step_count += 0 if outcome.skipped else 1
        traffic = self._traffic(sched, inputs.seq)
        stats = [d.backend.memory_stats() for d in self.devices]
        result = StepResult(
            loss=loss, grad_norm=outcome.grad_norm, clipped=outcome.clipped, skipped=outcome.skipped,
            tokens=int(inputs.batch * inputs.seq), seconds=time.perf_counter() - t0,
            step=self.step_count, lr=lr, timings=state.timings,
            h2d_bytes=traffic.h2d_bytes, d2h_bytes=traffic.d2h_bytes,
            device_peak_allocated=max((st.get("peak_allocated", 0) for st in stats), default=0),
            device_peak_reserved=max((st.get("peak_reserved", 0) for st in stats), default=0),
        )
        if outcome.nonfinite is not None and self.config.nonfinite == "raise":
            raise NonFiniteError(
                f"step {self.step_count + 1}: non-finite {outcome.nonfinite} (loss={loss}); "
                "layers after it were not updated"
                + ("" if self._retained is None else " and earlier ones were rolled back")
            )
        return result

    def _device_layers(self) -> set[int]:
        return {layer for d in self.devices if d.optim is not None for layer in d.optim.states}

    def _step_on_devices(self, updater: StepUpdater, coef: float, lr: float) -> None:
        """AdamW for the layers whose state lives on their device, queued on its compute stream
        (the next step's kernels there run after it)."""
        for d in self.devices:
            if d.optim is None:
                continue
            for layer, step in updater.device_steps:
                if d.optim.owns(layer):
                    with d.backend.use_stream(d.streams["compute"]):
                        d.optim.step(layer, self.optimizer, d.pool.grads(layer, None), coef, step, lr,
                                     d.pool.params(layer, None))

    def _traffic(self, sched: Schedule, seq: int) -> Traffic:
        if not any(b.is_cuda for b in self.backends):
            return Traffic(0, 0)
        key = (sched.batch, seq)
        if key not in self._traffic_cache:
            esize = torch.empty((), dtype=self.dtype).element_size()
            self._traffic_cache[key] = step_traffic(sched, self.store, seq, self.hidden_size, esize, esize,
                                                    on_device=self._device_layers())
        return self._traffic_cache[key]

    # ------------------------------------------------------------------ state

    def synchronize(self) -> None:
        """Wait until the host copy of every weight and optimizer state is final; from then on it is
        authoritative again (changes made to it are what the next step trains on).

        With clipping, part of a step's optimizer work finishes in the background while the next
        step starts (see :mod:`tinypipe.runtime.deferred`). The engine's own readers (state_dict,
        checkpoints, saving, :func:`tinypipe.train.train`'s return) call this; call it yourself
        before reading ``engine.model``'s parameters directly after :meth:`step`."""
        self._deferred.wait_all()
        for d in self.devices:
            if d.optim is not None:
                d.optim.store()  # layers stepped on their device: copy master and moments back
                d.optim.invalidate()  # and reload them next step, with any change made on the host

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights under the keys of ``model.state_dict()`` (live views); frozen
        parameters (LoRA base weights) at the compute precision."""
        self.synchronize()
        return self.store.state_dict()

    def optimizer_state(self) -> dict[str, object]:
        """AdamW moments and step counts per layer (live views), for checkpoints."""
        self.synchronize()
        return {
            s.spec.name: {"exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq, "step": s.step}
            for s in self.store.layers
        }

    def save_checkpoint(self, path: str | os.PathLike, extra: dict | None = None) -> Path:
        """Atomically write master weights, AdamW state and step counts (+ ``extra``, e.g. the data
        position and RNG states) so :meth:`load_checkpoint` resumes exactly."""
        # whether the last step clipped decides how the next one steps (speculate or defer); the
        # two paths round differently, so a resumed run must take the same one
        self.synchronize()
        meta = dict(extra or {}, **{_ENGINE_KEY: {"last_clipped": self._last_clipped}})
        return save_checkpoint(self.store, self.step_count, path, meta)

    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Restore the state written by :meth:`save_checkpoint`; returns its ``extra``."""
        self.synchronize()  # the next step loads any device-side state from the checkpoint
        self.step_count, extra = load_checkpoint(self.store, path)
        extra = dict(extra)
        self._last_clipped = bool(extra.pop(_ENGINE_KEY, {}).get("last_clipped", False))
        return extra

    def save_pretrained(self, out_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
        """Write a directory ``AutoModelForCausalLM.from_pretrained`` loads (config + safetensors).

        A LoRA engine (built from a ``peft.PeftModel``) writes the adapter instead, in PEFT's format
        (``PeftModel.from_pretrained(base, out_dir)`` loads it); merged weights:
        :func:`tinypipe.lora.save_merged`."""
        self.synchronize()
        if self.peft_model is not None:
            return save_adapter(self, out_dir)

        def tensors():
            for s in self.store.layers:
                for p in s.spec.params:
                    yield p.name, s.param_view(p)

        try:
            return save_hf_directory(self.model, tensors(), out_dir, dtype=dtype)
        except OSError as exc:
            if isinstance(exc, WriteError):
                raise
            from tinypipe.runtime.checkpoint import describe_os_error

            for partial in Path(out_dir).glob("*.safetensors.tmp"):  # give the space back
                partial.unlink(missing_ok=True)
            raise WriteError(f"cannot save the model to {out_dir}: {describe_os_error(exc)}") from exc

    def close(self) -> None:
        """Stop the lane threads and unpin host memory; the engine is unusable afterwards."""
        try:
            self.synchronize()  # the model's parameters (views of the host copy) stay usable
        except WorkerError:
            pass  # the failure was raised by step() already or is in self._deferred.error
        self._workers.shutdown()
        self.pinner.release()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
