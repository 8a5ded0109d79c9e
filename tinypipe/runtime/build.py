"""Building an engine's resources, one named step each: the host store (after a host-memory
check), each device's runtime with the AdamW state of the layers stepped there, the optimizer
path, and the lane workers bundled with the rest as
:class:`~tinypipe.runtime.resources.EngineResources`."""

from __future__ import annotations

import os

import torch
from torch import nn

from tinypipe.config import Config
from tinypipe.devices.backend import Backend, HostPinner
from tinypipe.distributed.group import Replicas
from tinypipe.distributed.shards import padded_numel
from tinypipe.errors import ConfigError, PlanDoesNotFitError
from tinypipe.memory.budget import check_host_memory
from tinypipe.memory.device_pool import DevicePool
from tinypipe.memory.grad_pool import HostGradPool, buffer_count, chunk_numel
from tinypipe.memory.host_store import HostStore, offload_regions
from tinypipe.models.compiled import resolve_backend
from tinypipe.models.decompose import Decomposition, LayerSpec
from tinypipe.models.head_loss import HeadLoss
from tinypipe.models.placement import IN_PLACE_MARK
from tinypipe.models.segment_attention import segment_attention_for
from tinypipe.models.shell import Shell
from tinypipe.planner.ssd import sharded_ssd_refusal
from tinypipe.runtime.device import DeviceRuntime
from tinypipe.runtime.optim.adamw import ChunkedAdamW
from tinypipe.runtime.optim.decay import DecayGroups, hf_decay_names
from tinypipe.runtime.optim.device_state import DeviceOptimizerState
from tinypipe.runtime.optim.path import OptimizerPath, retains_gradients
from tinypipe.runtime.optim.sharded import ShardedOptimizerPath, ShardView
from tinypipe.runtime.optim.ssd_tier import SsdTier
from tinypipe.runtime.resources import EngineResources
from tinypipe.runtime.rng import DropoutRng
from tinypipe.runtime.signals import POLL_S
from tinypipe.runtime.ssd_stash import SsdStash
from tinypipe.runtime.stash_io import HostStash, ReadAheadBuffers
from tinypipe.runtime.workers import LaneWorkers
from tinypipe.schedule.plan import Plan
from tinypipe.schedule.staging import DEFAULT_READ_AHEAD, staging_pools
from tinypipe.schedule.transient_grads import transient_grad_layers, transient_weight_layers

STAGING_MAX = 32 * 1024 * 1024  # elements: the fp32 upload staging buffer (128 MiB) -- chunks larger layers


def _one_line(exc: BaseException, limit: int) -> str:
    return " ".join(str(exc).split())[:limit]


class EngineBuilder:
    """What an engine is built from (model, config, plan, devices, precision), and the steps."""

    def __init__(self, model: nn.Module, config: Config, plan: Plan, decomposition: Decomposition,
                 backends: list[Backend], dtype: torch.dtype, replicas: Replicas | None = None,
                 mlp_chunk_tokens: int = 0, attention_tile_tokens: int | None = None) -> None:
        self.model, self.config, self.plan, self.dec = model, config, plan, decomposition
        self.mlp_chunk_tokens = mlp_chunk_tokens  # the blocks' MLP chunk (0: unchunked)
        self.attention_tile_tokens = attention_tile_tokens  # None: the default tile
        self.backends, self.dtype = backends, dtype
        self.replicas = replicas  # data-parallel replicas (None: this engine alone)
        self.sharded = replicas is not None and plan.optimizer_sharding == "shard"
        self.any_cuda = any(b.is_cuda for b in backends)
        self.pinner = HostPinner(enabled=self.any_cuda and config.pin_memory == "register")
        self.retain = retains_gradients(config.max_grad_norm, config.nonfinite)

    def host_store(self) -> HostStore:
        """The one host copy of the training state, after checking that it fits in host memory
        (state the plan offloads to the SSD is written to the offload directory instead)."""
        model = self.model
        n_params = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # what the store still allocates: AdamW moments, the fp32 master unless a loader already
        # placed it (tinypipe.load_model), the retained gradient, frozen weights at compute precision
        per = 8 + (0 if model.__dict__.get(IN_PLACE_MARK) else 4) + (4 if self.retain else 0)
        if self.sharded and self.replicas is not None:  # moments and retained gradient: this rank's shard
            per = 8 / self.replicas.size + (0 if model.__dict__.get(IN_PLACE_MARK) else 4) + (
                4 / self.replicas.size if self.retain else 0)
        # frozen bytes as laid out (QLoRA's packed payload is far smaller than the dense count)
        need = int(per * trainable) + sum(s.frozen_numel for s in self.dec.layers) * self.dtype.itemsize
        if not model.__dict__.get(IN_PLACE_MARK):
            need -= _replaced_bytes(model, self.dec, self.dtype)
        offload = self._offload()
        if offload:
            regions = offload_regions(self.dec, offload, self.dtype, self.retain)
            need -= sum(n * dt.itemsize for (_, name), (n, dt) in regions.items()
                        if name != "master" or not model.__dict__.get(IN_PLACE_MARK))
            sizes = {k: n * dt.itemsize for k, (n, dt) in regions.items()}
            need += staging_pools(self.plan, self.dec.tied, sizes, self._read_ahead()).nbytes
        check_host_memory(need, f"the training state of {n_params / 1e6:.1f} M parameters")
        try:
            return HostStore(model, self.dec, self.pinner, frozen_dtype=self.dtype, offload=offload,
                             offload_dir=self.config.offload_dir, retain_grad=self.retain)
        except (MemoryError, RuntimeError) as exc:
            if isinstance(exc, RuntimeError) and "allocate" not in str(exc):
                raise
            raise PlanDoesNotFitError(f"host memory: cannot allocate the training state of "
                                      f"{n_params / 1e6:.1f} M parameters ({_one_line(exc, 200)})") from exc

    def _offload(self) -> dict[int, frozenset[str]]:
        """The plan's offload set, checked against the config and the model (one-line errors)."""
        offload = self.plan.offloaded()
        if not offload:
            return offload
        if self.sharded:
            raise sharded_ssd_refusal()
        if self.config.offload_dir is None:
            raise ConfigError("the plan offloads training state to the SSD but no offload directory is "
                              "set: give Config(offload_dir=...) / --offload-dir DIR")
        lora = [layer for layer, kinds in offload.items()
                if "master" in kinds and self.dec.layers[layer].frozen_numel]
        if lora:
            raise ConfigError(f"plan: layer {lora[0]} has frozen (LoRA) weights and offloads its master "
                              "weights; the adapters' masters stay in DRAM (PEFT saves them from the model): "
                              "offload its 'frozen' weights or moments instead")
        return offload

    def _read_ahead(self) -> int:
        """Layers of optimizer state read ahead (``Config.extra["ssd_read_ahead"]``; see
        :data:`~tinypipe.schedule.staging.DEFAULT_READ_AHEAD` for why the default)."""
        return int(self.config.extra.get("ssd_read_ahead", DEFAULT_READ_AHEAD))

    def compile_backend(self) -> str | None:
        """The torch.compile backend for the decoder blocks (None: eager)."""
        backend = resolve_backend(self.config.compile_blocks, self.any_cuda)
        if backend is not None and backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise ConfigError(f"compile_blocks: unknown torch.compile backend {backend!r}")
        return backend

    def devices(self, store: HostStore,
                compile_backend: str | None) -> tuple[list[DeviceRuntime], dict[int, DeviceOptimizerState]]:
        """Every device's runtime, and the AdamW state of the devices that step layers."""
        runtimes, states = [], {}
        for i, backend in enumerate(self.backends):
            runtime, state = self.device(i, backend, store, compile_backend)
            runtimes.append(runtime)
            if state is not None:
                states[i] = state
        return runtimes, states

    def device(self, i: int, backend: Backend, store: HostStore,
               compile_backend: str | None) -> tuple[DeviceRuntime, DeviceOptimizerState | None]:
        """Device ``i``'s layer slots and resident layers, its host gradient pool and model shell,
        and the AdamW state of the layers stepped on it."""
        cfg, dec, plan = self.config, self.dec, self.plan
        slot_numel = max(layer.numel for layer in dec.blocks)
        grad_numel = max(layer.train_numel for layer in dec.blocks)  # frozen parameters: no gradients
        pad = self._grad_room  # sharded: room for an equal-pieces reduce-scatter
        has_packs = i in plan.fwd_device or i in plan.bwd_device
        resident = self._resident_layers(i)
        try:
            pool = DevicePool(
                backend,
                self.dtype,
                slot_numel,
                plan.param_slots() if has_packs else 0,
                plan.grad_slot_count() if has_packs else 0,
                {layer: s.numel for layer, s in resident.items()},
                staging_numel=min(slot_numel, STAGING_MAX),
                grad_numel=pad(grad_numel),
                resident_grad={layer: pad(s.train_numel) for layer, s in resident.items()},
                assist=bool(plan.assisted),
                transient_grads=transient_grad_layers(plan, dec.tied, self.mlp_chunk_tokens > 0),
                transient_weights=transient_weight_layers(
                    plan, dec.tied, frozenset(layer for layer, s in resident.items() if not s.train_numel),
                    self.mlp_chunk_tokens > 0),
            )
        except torch.OutOfMemoryError as exc:
            raise self._no_room(i, exc) from exc
        # retained gradients (clipping, non-finite skip) are downloaded straight into their
        # page-locked host buffers: the staging pool would be an extra 4 B/param copy per step
        pool_buffers = 0 if self.retain else buffer_count(max(1, grad_numel), cfg.host_grad_buffers)
        gpool = HostGradPool(pool_buffers, chunk_numel(max(1, grad_numel)), self.pinner, POLL_S)
        shell = Shell(self.model, dec, backend.device, dropout=cfg.dropout,
                      mlp_chunk_tokens=self.mlp_chunk_tokens,
                      segment_attention=segment_attention_for(cfg.segment_attention, cfg.seq_len),
                      attention_tile_tokens=self.attention_tile_tokens)
        if compile_backend is not None:
            shell.compile_blocks(compile_backend, replay_random=cfg.dropout)
        runtime = DeviceRuntime(i, cfg.devices[i], backend, shell, pool, gpool)
        owned = plan.device_optimized(i)
        if not owned:
            return runtime, None
        try:
            state = DeviceOptimizerState(backend, runtime.streams["compute"], pool,
                                         {layer: store.layers[layer] for layer in owned})
        except torch.OutOfMemoryError as exc:
            raise self._no_room(i, exc) from exc
        return runtime, state

    def _grad_room(self, n: int) -> int:
        """Gradient accumulator elements for a layer of ``n``: padded to R equal shards when sharded."""
        return padded_numel(n, self.replicas.size) if self.sharded and self.replicas is not None else n

    def _resident_layers(self, i: int) -> dict[int, LayerSpec]:
        """The layers resident on device ``i``: the embedding, the head, the resident packs'
        blocks (never swapped, stepped there)."""
        dec, plan = self.dec, self.plan
        layers = {}
        if i == plan.embed_device:
            layers[0] = dec.embed
        if i == plan.head_device:
            layers[dec.num_blocks + 1] = dec.head
        for layer in plan.resident_layers(i):
            layers[layer] = dec.blocks[layer - 1]
        return layers

    def _no_room(self, i: int, exc: BaseException) -> PlanDoesNotFitError:
        return PlanDoesNotFitError(
            f"device {self.config.devices[i]}: out of memory for its layer slots and resident layers "
            f"({_one_line(exc, 160)}); lower pack_size or the micro-batch, use more devices, "
            "or run `tinypipe plan` to see what fits")

    def optimizer(self, store: HostStore, device_states: dict[int, DeviceOptimizerState]) -> OptimizerPath:
        cfg = self.config
        cores = os.cpu_count() or 1
        # leave cores for the lanes that feed the GPUs; an OpenMP team sharing a core with a busy
        # lane runs at the straggler's pace
        threads = cfg.optimizer_threads or (max(1, cores - 1 - len(self.backends)) if self.any_cuda else None)
        tier = None
        if store.offload is not None:
            tier = SsdTier(store, self.plan, self.dec.tied, self.pinner, read_ahead=self._read_ahead())
        adamw = ChunkedAdamW(cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay, self.decay_groups())
        if self.sharded and self.replicas is not None:
            on_device = frozenset(layer for st in device_states.values() for layer in st.states)
            view = ShardView(store, self.replicas, on_device)
            return ShardedOptimizerPath(view, self.replicas, adamw=adamw, max_grad_norm=cfg.max_grad_norm,
                                        nonfinite=cfg.nonfinite, device_states=device_states,
                                        pin=self.pinner.pin, threads=threads)
        return OptimizerPath(store, adamw, max_grad_norm=cfg.max_grad_norm, nonfinite=cfg.nonfinite,
                             device_states=device_states, pin=self.pinner.pin, threads=threads, tier=tier,
                             assisted=self.plan.assisted, deferred=self.plan.deferred)

    def decay_groups(self) -> DecayGroups:
        """What AdamW decays: HF Trainer's rule (no biases, no norm weights) unless ``decay_all``."""
        if self.config.decay_all:
            return DecayGroups()
        return DecayGroups.build(self.dec.layers, hf_decay_names(self.model))

    def resources(self, store: HostStore, devices: list[DeviceRuntime], optimizer: OptimizerPath,
                  hidden_size: int, head_chunk_tokens: int) -> EngineResources:
        """Start the lane workers; bundle every resource a step uses."""
        cfg = self.config
        return EngineResources(
            devices=devices, store=store, optimizer=optimizer, workers=LaneWorkers(),
            host_stash=HostStash(self.pinner), read_ahead=ReadAheadBuffers(), compute_dtype=self.dtype,
            hidden_size=hidden_size, head_chunk_tokens=head_chunk_tokens,
            optimizer_threads=optimizer.threads, trace=cfg.trace, check_finite=cfg.check_finite,
            stall_timeout_s=cfg.stall_timeout_s,
            rng=DropoutRng.from_seed(cfg.dropout_seed) if cfg.dropout else None,
            replicas=self.replicas, head_loss=HeadLoss(self.compile_backend()),
            long_sequences=self.mlp_chunk_tokens > 0,
            ssd_stash=SsdStash(self.pinner, cfg.offload_dir) if self.plan.stash_on_ssd else None,
        )


def _replaced_bytes(model: nn.Module, dec: Decomposition, dtype: torch.dtype) -> int:
    """Host bytes the store frees while it is built: it copies one layer at a time and re-points
    the model's parameters at the copy (``param.data = view``), so their old host storage goes
    (a model built in Python, not by tinypipe's loader). Less the largest layer, which exists
    twice for a moment. Counting it as kept refused a 7B model on a 128 GiB machine where its run
    fitted (docs/measured.md). Storage another object still
    references is not freed: ``TINYPIPE_SKIP_HOST_MEMORY_CHECK`` is the way out of a wrong guess."""
    seen: set[int] = set()
    freed = 0
    for param in model.parameters():
        if param.device.type != "cpu" or param.is_meta:
            continue
        storage = param.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        freed += storage.nbytes()
    largest = max((s.train_numel * 4 + s.frozen_numel * dtype.itemsize for s in dec.layers), default=0)
    return max(0, freed - largest)
