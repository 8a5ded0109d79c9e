"""The Engine: a Hugging Face causal LM trained through Tiny-Pipe swapping on 1..N devices.

With ``torch.distributed`` initialised over several ranks (``torchrun``), each rank's engine is
one data-parallel replica (:mod:`tinypipe.runtime.replica_setup`, :mod:`tinypipe.distributed`):
it trains its rows of every global batch, each layer's gradient is summed across the replicas on
a collective lane before its download, and with ``Plan.optimizer_sharding == "shard"`` it steps
only its shard of the host optimizer state (:mod:`~tinypipe.runtime.optim.sharded`).

Construction builds, in order: the host store (one copy of the training state; with
``Plan.offload`` part of it in a scratch file under ``Config.offload_dir``), each device's runtime
(slots, resident layers, host gradient pool, model shell), the optimizer path (with its SSD tier,
:mod:`~tinypipe.runtime.optim.ssd_tier`) and the lane workers -- bundled as
:class:`~tinypipe.runtime.resources.EngineResources`. A step runs the schedule through
:class:`~tinypipe.runtime.step.StepRunner` and closes with the optimizer path.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

import torch
from torch import nn

from tinypipe.config import Config
from tinypipe.devices.backend import make_backend
from tinypipe.errors import ConfigError, NonFiniteError, StorageError, WorkerError, WriteError
from tinypipe.lora.hooks import save_adapter, split_peft
from tinypipe.memory.host_store import HostStore
from tinypipe.memory.report import MemoryReport
from tinypipe.models.decompose import Decomposition
from tinypipe.models.export import save_hf_directory
from tinypipe.models.chunked_mlp import mlp_chunk_tokens_for
from tinypipe.models.head import chunk_tokens_for
from tinypipe.planner.auto import check_keepable
from tinypipe.planner.probe import shape_of
from tinypipe.quant.hooks import HOOKS as QUANT_HOOKS
from tinypipe.runtime.build import EngineBuilder
from tinypipe.runtime.checkpoint import check_layout, load_checkpoint, save_checkpoint, setting_differences
from tinypipe.runtime.checkpoint_sharded import find_sharded, load_replicas, save_replicas, sharded_extra
from tinypipe.runtime.context import TaskTiming
from tinypipe.runtime.evaluate import EvalResult, Evaluator
from tinypipe.runtime.exit_guard import ExitGuard
from tinypipe.runtime.inputs import StepInputs, prepare_inputs
from tinypipe.runtime.observability import RssPeak, StepTimeline, memory_report, ssd_timings, timeline_events
from tinypipe.runtime.optim.background import BackgroundUpdates
from tinypipe.runtime.optim.decisions import StepOutcome
from tinypipe.runtime.optim.path import retains_gradients
from tinypipe.runtime.replica_setup import (check_replicas_agree, guard_exits, join_replicas, local_batch,
                                            local_devices, replica_plan, resolve_replica_plan)
from tinypipe.runtime.step import StepRunner
from tinypipe.runtime.traffic import Traffic, step_traffic
from tinypipe.runtime.workers import LaneWorkers
from tinypipe.schedule.builder import build_schedule
from tinypipe.schedule.ids import BACKGROUND_LANE, update_id
from tinypipe.schedule.plan import Plan
from tinypipe.schedule.render import chrome_trace, to_text
from tinypipe.schedule.tasks import Schedule, Task
from tinypipe.schedule.validate import validate
from tinypipe.storage import IoTotals
from tinypipe.write_errors import describe, os_errors

if TYPE_CHECKING:
    from tinypipe.distributed.group import Replicas
    from tinypipe.planner.search import PlanResult

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_ENGINE_KEY = "_tinypipe_engine"  # the engine's own state inside a checkpoint's extra


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
    # the SSD tier's traffic during the step (Config.offload_dir; 0 without it): bytes moved, and
    # GB/s over the time requests were in flight (several at once count once)
    ssd_read_bytes: int = 0
    ssd_write_bytes: int = 0
    ssd_read_gbps: float = 0.0
    ssd_write_gbps: float = 0.0


def _prefer_expandable_segments() -> None:
    """Use expandable allocator segments unless the user configured the allocator.

    Activations of varying sizes otherwise fragment fixed segments: measured on a 3B model, 7.5 GiB
    allocated needed 12.2 GiB reserved.
    """
    if "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return
    try:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except Exception:  # noqa: BLE001 - an allocator without the option: keep its default
        pass


def _attention_tile(cfg: Config, result: PlanResult | None, replicas: Replicas | None) -> int | None:
    """The attention tile the shells run: ``Config.attention_tile_tokens`` if set, else the tile the
    planner sized and timed its plan with (rank 0's, as its plan is: every replica rounds alike),
    else None (the default tile)."""
    if cfg.attention_tile_tokens is not None:
        return cfg.attention_tile_tokens
    tile = (result.attention_tile_tokens or None) if result is not None else None
    if replicas is not None:
        first = replicas.host.all_gather_object(tile)[0]
        tile = None if first is None else int(first)  # type: ignore[call-overload]
    return tile


def _mlp_chunk(cfg: Config, model: nn.Module, dtype: torch.dtype) -> int:
    """Tokens per chunk of the blocks' MLPs for ``cfg`` (0: unchunked; the model's shape is read
    only when the choice is automatic and the sequence long)."""
    if cfg.mlp_chunk_tokens is not None or cfg.seq_len is None:
        return mlp_chunk_tokens_for(cfg.mlp_chunk_tokens, 1, dtype.itemsize, cfg.seq_len)
    return mlp_chunk_tokens_for(None, shape_of(model.config)["intermediate"], dtype.itemsize, cfg.seq_len)


def _stop(background: BackgroundUpdates, workers: LaneWorkers, store: HostStore) -> None:
    """Finish background optimizer work, stop the lane threads, remove the SSD tier's scratch
    files (engine finalizer)."""
    background.wait_quietly()
    workers.shutdown(0.0)
    store.close()


class Engine:
    """Trains ``model`` (a Hugging Face causal LM) with Tiny-Pipe's layer-wise swapping.

    The model's parameters move into the engine's host store (one fp32 copy; the model's
    parameters become views of it). Every :meth:`step` streams layers through the configured
    devices and steps AdamW on the host, overlapped with the backward pass.

    ``engine.plan`` is what runs: ``plan`` if given, else the plan of ``config``'s packing knobs
    or, with none set, the planner's choice (``engine.plan_result`` holds the planner's answer;
    see :class:`tinypipe.Config`). ``engine.config`` stays as given.
    """

    def __init__(self, model: nn.Module, config: Config | None = None, plan: Plan | None = None) -> None:
        self.config = cfg = config or Config()  # as given: the plan's settings live in self.plan
        given = model
        # a peft.PeftModel (LoRA): train its inner model; frozen base weights stay at compute precision
        self.peft_model, model = split_peft(model)
        self.model = model
        # a quantized base (QLoRA) is laid out and copied with the quantization layer's helpers
        self.decomposition = dec = Decomposition(model, quant=QUANT_HOOKS)
        # the plan given, else the hand-set knobs' or (none set) the planner's; PlanDoesNotFitError
        # (one line) when it cannot fit
        # data-parallel replicas (torch.distributed initialised with several ranks): every rank runs
        # this engine on its rows of each global batch; None alone
        self.replicas = join_replicas(cfg)
        #: ends the process from another thread without a half-written checkpoint (a dead peer)
        self.exit_guard = ExitGuard()
        guard_exits(self.replicas, self.exit_guard)
        try:
            self._assemble(given, model, cfg, dec, plan)
        except BaseException:  # the peers stop too, now, instead of waiting in a collective
            if self.replicas is not None:
                self.replicas.close(failed=True)
            raise

    def _assemble(self, given: nn.Module, model: nn.Module, cfg: Config, dec: Decomposition,
                  plan: Plan | None) -> None:
        """The rest of construction, once the replicas are joined: the plan, the host store, the
        devices, the optimizer and the lanes."""
        self.plan, self.plan_result = resolve_replica_plan(
            given, cfg, self.replicas, num_blocks=dec.num_blocks, tied=dec.tied, plan=plan)
        self.plan = replica_plan(self.plan, self.replicas, adopt_rank0=plan is None)
        check_keepable(self.plan, model)
        if self.replicas is not None:
            check_replicas_agree(self.replicas, cfg, self.plan, model)
        topo = self.replicas.topology if self.replicas is not None else None
        self.backends = [make_backend(d) for d in local_devices(cfg, topo)]
        self.dtype = _DTYPES[cfg.precision]
        #: tokens per chunk of the decoder blocks' MLPs (0: unchunked; Config.mlp_chunk_tokens)
        self.mlp_chunk = _mlp_chunk(cfg, model, self.dtype)
        #: tokens per attention tile of a long segment (Config.attention_tile_tokens, else the
        #: planner's choice, else the default; models/tiled_attention.py)
        self.attention_tile = _attention_tile(cfg, self.plan_result, self.replicas)
        build = EngineBuilder(model, cfg, self.plan, dec, self.backends, self.dtype, self.replicas,
                              mlp_chunk_tokens=self.mlp_chunk, attention_tile_tokens=self.attention_tile)
        self._any_cuda = build.any_cuda
        self.pinner = build.pinner
        self.store = build.host_store()
        self.hidden_size = int(model.config.hidden_size)
        self.head_chunk = cfg.head_chunk_tokens or chunk_tokens_for(int(model.config.vocab_size))
        self.compile_backend = build.compile_backend()
        self.devices, device_states = build.devices(self.store, self.compile_backend)
        self.optimizer = build.optimizer(self.store, device_states)
        self.resources = build.resources(self.store, self.devices, self.optimizer, self.hidden_size,
                                         self.head_chunk)
        # an engine dropped (or alive at interpreter exit) with a background update still running:
        # finish it first -- torch kernels running in a thread while the interpreter tears down
        # abort the process ("terminate called without an active exception")
        weakref.finalize(self, _stop, self.optimizer.background, self.resources.workers, self.store)
        self._runner = StepRunner(self.resources)
        self._evaluator = Evaluator(self.resources, self.plan)
        self._schedules: dict[int, Schedule] = {}
        self._traffic_cache: dict[tuple[int, int], Traffic] = {}
        self._broken: str | None = None
        # set when a non-finite step left some layers updated (nothing to undo them from): the
        # state mixes two steps, so steps and checkpoints are refused until load_checkpoint
        self._mixed: str | None = None
        self._last: StepTimeline | None = None
        self._rss = RssPeak()
        self.fault: Callable[[Task], None] | None = None  # test hook: called before every task
        if self._any_cuda:
            _prefer_expandable_segments()
        # an unschedulable plan fails here, not at step 1
        validate(build_schedule(self.plan, 1, dec.tied, reduce=self.replicas is not None,
                                long_sequences=self.mlp_chunk > 0))

    # ------------------------------------------------------------------ training

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (skipped steps do not count; restored by :meth:`load_checkpoint`)."""
        return self.optimizer.step_count

    def schedule_for(self, batch: int) -> Schedule:
        """The (validated) schedule for a global batch of ``batch`` sequences."""
        if batch not in self._schedules:
            sched = build_schedule(self.plan, batch, self.decomposition.tied,
                                   reduce=self.replicas is not None, long_sequences=self.mlp_chunk > 0)
            validate(sched)
            self._schedules[batch] = sched
        return self._schedules[batch]

    def step(self, batch: Mapping[str, torch.Tensor], lr: float | None = None) -> StepResult:
        """One optimizer step over the global ``batch`` (dict with input_ids, optional
        attention_mask and labels; labels default to input_ids with padding ignored). With
        replicas, every rank passes the same global batch and trains its rows of it."""
        with self._peers_explained():
            return self._step(batch, lr)

    @contextlib.contextmanager
    def _peers_explained(self) -> Iterator[None]:
        """With replicas: a collective that fails in the body (a peer died, stopped or hangs) is
        explained by the watchdog -- by default it ends this process with its one line; else a
        WorkerError with that line."""
        if self.replicas is None:
            yield
            return
        try:
            yield
        except Exception as exc:
            verdict = self.replicas.explain_failure(exc)
            if verdict is None:
                raise
            self._broken = verdict
            raise WorkerError(verdict) from exc

    def _step(self, batch: Mapping[str, torch.Tensor], lr: float | None) -> StepResult:
        self._check_usable()
        t0 = time.perf_counter()
        inputs = self._inputs(batch if self.replicas is None else local_batch(batch, self.replicas))
        if self.replicas is not None:  # the loss is normalised by the whole global batch's tokens
            inputs.denom = self.replicas.total_tokens(inputs.denom)
        sched = self.schedule_for(inputs.batch)
        self.resources.host_stash.prepare(self.plan, inputs.batch, inputs.seq, self.hidden_size, self.dtype,
                                          self.resources.long_sequences)
        if self.resources.ssd_stash is not None:  # pack inputs on the SSD (Plan.stash_on_ssd)
            self.resources.ssd_stash.prepare(self.plan, inputs.batch, inputs.seq, self.hidden_size,
                                             self.dtype)
        lr = self.config.lr if lr is None else float(lr)
        self.optimizer.begin_step(lr, sched.upload_order())
        for d in self.devices:
            d.backend.reset_peak()
            d.grad_pool.reset()
        ctx = self._runner.new_context(sched, inputs, self.fault)
        try:
            self.optimizer.start_staging(sched, ctx.abort, self.resources.workers)
            self._runner.run(ctx)
        except (WorkerError, StorageError) as exc:
            # no lane thread outlives a failed step (a stuck one is abandoned)
            self.resources.workers.shutdown()
            if self.resources.ssd_stash is not None:  # read-aheads nobody will consume
                self.resources.ssd_stash.end_step(failed=True)
            self.optimizer.abandon_step(self._sync_devices)
            if ctx.stuck:
                self._broken = f"a worker is still stuck in {ctx.stuck}"
            if self.optimizer.failed:  # the last step's update failed under this one
                self._broken = "the last step's optimizer update failed"
            if isinstance(exc, StorageError) or isinstance(exc.__cause__, StorageError):
                self._broken = "the SSD tier failed"  # an unreadable region: the state is lost
            if isinstance(exc.__cause__, NonFiniteError):  # check_finite located a NaN/inf
                raise NonFiniteError(str(exc.__cause__)) from exc
            raise
        if self.resources.ssd_stash is not None:
            self.resources.ssd_stash.end_step()
        try:
            outcome = self.optimizer.finish_step(self.resources.workers)
        except StorageError:
            self._broken = "the SSD tier failed"
            raise
        # the last step's leftover updates ran during this one: in this step's timeline
        ctx.timings[:0] = [TaskTiming(BACKGROUND_LANE, f"{update_id(layer)} (last step's, left over)", a, b)
                           for layer, a, b in outcome.background_timings]
        if self.optimizer.tier is not None:  # the SSD lanes: what the disk did during the step
            ctx.timings += ssd_timings(self.optimizer.tier.records, t0)
        self._last = StepTimeline(ctx.timings, t0)
        self._rss.sample()
        loss = ctx.loss_value if ctx.loss_value is not None else float("nan")
        result = self._result(outcome, inputs, sched, loss, lr, t0, ctx.timings)
        if outcome.nonfinite is not None and self.config.nonfinite == "raise":
            raise NonFiniteError(self._nonfinite_message(outcome, loss))
        return result

    def _sync_devices(self) -> None:
        for d in self.devices:
            try:
                d.backend.synchronize()
            except Exception:  # noqa: BLE001 - a broken device: nothing copies out of a slot then
                pass

    def _nonfinite_message(self, outcome: StepOutcome, loss: float) -> str:
        """What a non-finite step under ``nonfinite="raise"`` did to the state (see Config)."""
        head = f"step {self.step_count + 1}: non-finite {outcome.nonfinite} (loss={loss}); "
        if not outcome.not_rolled_back:
            rolled = retains_gradients(self.config.max_grad_norm, self.config.nonfinite)
            return head + "no layer was updated" + (" (those stepped were rolled back)" if rolled else "")
        names = [self.store.layers[layer].spec.name for layer in outcome.not_rolled_back]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        self._mixed = (f"step {self.step_count + 1} was non-finite after {shown} had been updated, and "
                       "nothing retained their gradients to undo it")
        return (head + f"{shown} already took this step's update (without max_grad_norm no gradient is "
                "retained to undo it from); the engine refuses further steps and checkpoints until "
                "load_checkpoint restores a consistent state")

    def evaluate(self, batch: Mapping[str, torch.Tensor]) -> EvalResult:
        """The loss of ``batch`` (same keys as :meth:`step`) with the current weights, forward only:
        no optimizer step, no stash, no gradients (:mod:`tinypipe.runtime.evaluate`), in eval mode
        (no dropout), packed rows per document, offloaded masters read from the SSD. Equals the
        model's own ``model(**batch, labels=...).loss`` in eval mode (fp32: to float rounding).
        Batches are combined with ``sum(r.loss_sum) / sum(r.tokens)``."""
        if self._broken is not None:
            self._check_usable()
        return self._evaluator.evaluate(self._inputs(batch))

    def _check_usable(self) -> None:
        if self._mixed is not None:
            raise NonFiniteError(f"engine state mixes two steps: {self._mixed}; restore it with "
                                 "load_checkpoint (the CLI: --resume)")
        if self._broken is not None:
            raise WorkerError(f"engine unusable: {self._broken}; create a new Engine (from the last "
                              "checkpoint)")
        if self.optimizer.failed:
            self._broken = "the last step's optimizer update failed"
            self.optimizer.wait_background()  # raises the cause

    def _inputs(self, batch: Mapping[str, torch.Tensor]) -> StepInputs:
        max_pos = getattr(self.model.config, "max_position_embeddings", None)
        return prepare_inputs(batch, int(self.model.config.vocab_size),
                              None if max_pos is None else int(max_pos), pin=self._any_cuda,
                              document_masks=self.decomposition.document_masks)

    def _result(self, outcome: StepOutcome, inputs: StepInputs, sched: Schedule, loss: float, lr: float,
                t0: float, timings: list[TaskTiming]) -> StepResult:
        traffic = self._traffic(sched, inputs.seq)
        assist = self.optimizer.assist
        if assist is not None:  # this step's uploads that ran the last step's clipped updates
            up, down = assist.moved()
            traffic = Traffic(traffic.h2d_bytes + up, traffic.d2h_bytes + down)
        stats = [d.backend.memory_stats() for d in self.devices]
        tier = self.optimizer.tier
        io = tier.last_io if tier is not None else IoTotals()
        stash = self.resources.ssd_stash
        stash_read, stash_write = (0, 0) if stash is None else stash.step_bytes()
        return StepResult(
            loss=loss, grad_norm=outcome.grad_norm, clipped=outcome.clipped, skipped=outcome.skipped,
            tokens=int(inputs.batch * inputs.seq) * (1 if self.replicas is None else self.replicas.size),
            seconds=time.perf_counter() - t0,
            step=self.step_count, lr=lr, timings=timings,
            h2d_bytes=traffic.h2d_bytes, d2h_bytes=traffic.d2h_bytes,
            device_peak_allocated=max((st.get("peak_allocated", 0) for st in stats), default=0),
            device_peak_reserved=max((st.get("peak_reserved", 0) for st in stats), default=0),
            # (plus the pack inputs stashed on the SSD, Plan.stash_on_ssd; the rates are the state's)
            ssd_read_bytes=io.read_bytes + stash_read, ssd_write_bytes=io.write_bytes + stash_write,
            ssd_read_gbps=io.read_gbps,
            ssd_write_gbps=io.write_gbps,
        )

    def _traffic(self, sched: Schedule, seq: int) -> Traffic:
        if not self._any_cuda:
            return Traffic(0, 0)
        key = (sched.batch, seq)
        if key not in self._traffic_cache:
            esize = torch.empty((), dtype=self.dtype).element_size()
            self._traffic_cache[key] = step_traffic(sched, self.store, seq, self.hidden_size, esize, esize,
                                                    on_device=self.optimizer.device_layers,
                                                    long_sequences=self.resources.long_sequences)
        return self._traffic_cache[key]

    # ------------------------------------------------------------------ observability

    def memory_report(self) -> MemoryReport:
        """Host bytes by category, device bytes by category, and measured peaks."""
        return memory_report(self.resources, self._rss)

    def schedule_text(self, batch: int) -> str:
        return to_text(self.schedule_for(batch))

    def step_timeline(self) -> list[dict]:
        """The last step's tasks as ``{"lane", "name", "start_us", "dur_us"}`` (device times for CUDA
        tasks when ``trace=True``, else host times); empty before the first step."""
        return timeline_events(self._last, self.config.trace)

    def export_trace(self, path: str | os.PathLike) -> Path:
        """Chrome/Perfetto trace of the last step (per lane; device times when ``trace=True``)."""
        if self._last is None:
            raise ConfigError("no step has run yet: nothing to trace")
        return chrome_trace(timeline_events(self._last, self.config.trace), path)

    # ------------------------------------------------------------------ state

    def synchronize(self) -> None:
        """Wait until the host copy of every weight and optimizer state is final; from then on it is
        authoritative again (changes made to it are what the next step trains on).

        With clipping, part of a step's optimizer work finishes in the background while the next
        step starts (see :mod:`tinypipe.runtime.optim.background`). The engine's own readers
        (state_dict, checkpoints, saving, :func:`tinypipe.train.train`'s return) call this; call it
        yourself before reading ``engine.model``'s parameters directly after :meth:`step`. State on
        the SSD tier (``Plan.offload``) is final once its write-backs landed, which this waits for
        too (raising a failed one); the model's parameters of layers whose master weights live
        there are meta tensors: read them through :meth:`state_dict`."""
        self.optimizer.synchronize()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights under the keys of ``model.state_dict()`` (live views; copies read
        from the SSD for layers whose weights live there); frozen parameters (LoRA base weights)
        at the compute precision."""
        self.synchronize()
        return self.store.state_dict()

    def optimizer_state(self) -> dict[str, object]:
        """AdamW moments and step counts per layer (live views; copies read from the SSD where
        they live there), for checkpoints."""
        self.synchronize()
        return {
            s.spec.name: {"exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq, "step": s.step}
            for s in self.store.iter_layers()
        }

    def save_checkpoint(self, path: str | os.PathLike, extra: dict | None = None) -> Path:
        """Atomically write master weights, AdamW state and step counts (+ ``extra``, e.g. the data
        position and RNG states) so :meth:`load_checkpoint` resumes exactly; the optimizer settings
        (:meth:`checkpoint_settings`) are recorded with them."""
        if self._mixed is not None:  # never write a state that mixes two steps
            raise NonFiniteError(f"refusing to checkpoint: {self._mixed}")
        # whether the last step clipped decides how the next one steps (speculate or defer); the
        # two paths round differently, so a resumed run must take the same one
        self.synchronize()
        own = {"last_clipped": self.optimizer.last_clipped, "settings": self.checkpoint_settings()}
        meta = dict(extra or {}, **{_ENGINE_KEY: own})
        if self.replicas is not None:  # every rank calls this: its shard, or rank 0 the replicated state
            with self._peers_explained():
                return save_replicas(self.store, self.optimizer, self.replicas, self.step_count, path, meta,
                                     self.exit_guard)
        return save_checkpoint(self.store, self.step_count, path, meta, guard=self.exit_guard)

    def checkpoint_settings(self) -> dict[str, object]:
        """What a checkpoint records of how this engine steps (compared on load): precision, AdamW's
        betas, eps and weight decay, the weight-decay grouping, clipping."""
        cfg, groups = self.config, self.optimizer.adamw.groups
        grouping = ("every parameter decayed" if groups.rule == "all" else
                    f"HF rule, {len(groups.names)} parameters not decayed ({groups.record()['digest']})")
        return {"precision": cfg.precision, "betas": list(cfg.betas), "eps": cfg.eps,
                "weight decay": cfg.weight_decay, "weight-decay grouping": grouping,
                "max grad norm": cfg.max_grad_norm}

    def checkpoint_differences(self, path: str | os.PathLike) -> list[str]:
        """How the checkpoint at ``path`` was made differently from this engine (one phrase each;
        empty when it matches or predates the record). A checkpoint of another model or LoRA
        setting is a ConfigError here already."""
        extra = sharded_extra(path) if self.replicas is not None else None
        if extra is None:  # an ordinary checkpoint (a sharded run refuses it when loading)
            extra = check_layout(self.store, path)[1].get("extra", {}) if find_sharded(path) is None else {}
        recorded = extra.get(_ENGINE_KEY, {}).get("settings", {})
        return setting_differences(recorded, self.checkpoint_settings())

    def load_checkpoint(self, path: str | os.PathLike, force: bool = False) -> dict:
        """Restore the state written by :meth:`save_checkpoint`; returns its ``extra``.

        A checkpoint made with other optimizer settings (:meth:`checkpoint_differences`, e.g.
        another weight-decay grouping) is refused with one line unless ``force``."""
        differences = self.checkpoint_differences(path)
        if differences and not force:
            raise ConfigError(f"{path}: checkpoint made with other settings: {'; '.join(differences)} "
                              "(force=True / --force to load it anyway)")
        self.synchronize()  # the next step loads any device-side state from the checkpoint
        if self.replicas is not None:
            with self._peers_explained():
                loaded = load_replicas(self.store, self.optimizer, self.replicas, path)
            step_count, extra = loaded
        else:
            step_count, extra = load_checkpoint(self.store, path)
        extra = dict(extra)
        last_clipped = bool(extra.pop(_ENGINE_KEY, {}).get("last_clipped", False))
        self.optimizer.restore_counters(step_count, last_clipped)
        self._mixed = None  # the state is the checkpoint's, consistent again
        return extra

    def save_pretrained(self, out_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
        """Write a directory ``AutoModelForCausalLM.from_pretrained`` loads (config + safetensors).

        A LoRA engine (built from a ``peft.PeftModel``) writes the adapter instead, in PEFT's format
        (``PeftModel.from_pretrained(base, out_dir)`` loads it); merged weights:
        :func:`tinypipe.lora.save_merged`."""
        self.synchronize()
        with self._peers_explained():
            if self.replicas is not None and not self.replicas.is_main:  # every rank's masters are whole:
                self.replicas.host.barrier()  # rank 0 writes them; the others wait until it has
                return Path(out_dir)
            try:
                return self._save_pretrained(out_dir, dtype)
            finally:
                if self.replicas is not None:
                    self.replicas.host.barrier()

    def _save_pretrained(self, out_dir: str | os.PathLike, dtype: torch.dtype | None) -> Path:
        def tensors():
            for s in self.store.iter_layers():  # one layer in DRAM at a time where it lives on the SSD
                for p in s.spec.params:
                    yield p.name, s.param_view(p)

        try:
            with os_errors():  # safetensors' full disk is an OSError here
                if self.peft_model is not None:
                    return save_adapter(self.peft_model, out_dir)
                return save_hf_directory(self.model, tensors(), out_dir, dtype=dtype)
        except OSError as exc:
            if isinstance(exc, WriteError):
                raise
            for partial in Path(out_dir).glob("*.safetensors.tmp"):  # give the space back
                partial.unlink(missing_ok=True)
            raise WriteError(f"cannot save the model to {out_dir}: {describe(exc)}") from exc

    def close(self) -> None:
        """Stop the lane threads, remove the SSD tier's scratch files and unpin host memory; the
        engine is unusable afterwards."""
        if self.replicas is not None:  # ending on its own: a peer that stops too is no reason to exit
            self.replicas.ending()
        try:
            self.synchronize()  # the model's parameters (views of the host copy) stay usable
        except (WorkerError, StorageError):
            pass  # the failure was raised by step() already, or is the background work's
        self.resources.workers.shutdown()
        if self.resources.ssd_stash is not None:  # the stashed pack inputs' scratch files
            self.resources.ssd_stash.close()
        if self.optimizer.tier is not None:
            self.optimizer.tier.close()
        self.store.close()  # the SSD tier's scratch files
        self.pinner.release()
        if self.replicas is not None:
            self.replicas.close()  # the watchdog says this rank left on purpose

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
