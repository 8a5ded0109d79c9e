"""Engine configuration: one typed object whose fields, grouped in sections, say when to change them.

Each field is declared with its documentation (:func:`tinypipe.documented.setting`);
``docs/configuration.md`` is generated from the declarations (:mod:`tinypipe.config_reference`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import KW_ONLY, MISSING, dataclass
from typing import Literal, Sequence, get_args

from tinypipe.documented import Section, fields_text, setting
from tinypipe.errors import ConfigError, StorageError
from tinypipe.schedule.plan import (  # noqa: F401 - re-exported: the plan's choice sets
    DEVICE_OPTIMIZER_CHOICES,
    PLAN_SETTINGS,
    STASH_PLACES,
    DeviceOptimizer,
    StashPlace,
)
from tinypipe.storage.stripe import as_directories
from tinypipe.units import parse_bytes

#: Compute precision (master weights and AdamW state stay fp32).
Precision = Literal["fp32", "bf16"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
#: How the host master weights are made DMA-able.
PinMode = Literal["register", "pageable"]
PIN_MODES: tuple[PinMode, ...] = get_args(PinMode)
#: What a NaN/inf loss or gradient does.
NonFinitePolicy = Literal["raise", "skip"]
NONFINITE_POLICIES: tuple[NonFinitePolicy, ...] = get_args(NonFinitePolicy)
#: Data-parallel replicas' host optimizer state: the planner's choice, or forced (Plan.optimizer_sharding).
OptimizerShardingChoice = Literal["auto", "replicate", "shard"]
OPTIMIZER_SHARDING_CHOICES: tuple[OptimizerShardingChoice, ...] = get_args(OptimizerShardingChoice)


#: The fields the planner chooses (``Config.auto_plan`` when all are unset).
PLAN_KNOBS = ("pack_size", "micro_batch_size", "backward_micro_batch_size", "prefetch_window", "stash")
#: What unset knobs mean when at least one is set (tinypipe's defaults before automatic planning).
MANUAL_DEFAULTS = {"pack_size": 1, "micro_batch_size": 1, "prefetch_window": 1, "stash": "device",
                   "device_optimizer": "off", "resident_packs": 0, "keep_activations": False, "turn_packs": 0}


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


DEVICES = Section("Devices and precision", """
    Where the model trains and in what arithmetic.""")
WORKLOAD = Section("Workload", """
    What one optimizer step is. The automatic plan needs it on CUDA devices (memory depends on it);
    on CPU-only devices without it the hand-set defaults are used. Given with a hand-set plan, the
    engine checks that plan against the budgets too.""")
BUDGETS = Section("Memory budgets and hardware", """
    What a plan must fit, and the rates the time model ranks the plans that fit by.""")
SSD_TIER = Section("SSD tier", """
    Training state that does not fit in host memory, on fast local SSDs (docs/ssd_tier.md,
    docs/ssd_striping.md).""")
PLAN = Section("The plan: packing, micro-batches, placement", """
    Memory/speed knobs. Leave all of ``pack_size``, ``micro_batch_size``,
    ``backward_micro_batch_size``, ``prefetch_window`` and ``stash`` unset (None) and the engine
    chooses them with the planner (:func:`tinypipe.planner.plan`) for the model, the devices,
    the workload and the budgets, and refuses to start (:class:`PlanDoesNotFitError`, one line) when
    no plan fits. Set any of them and the plan is yours: unset ones take 1, the forward size, 1 and
    ``"device"``. ``device_optimizer`` / ``resident_packs`` / ``keep_activations`` / ``turn_packs``
    unset: the planner's choice when it plans, else ``"off"`` / 0 / none / 0; set, the planner keeps
    them. A whole plan can also be given to the engine (``Engine(..., plan=...)``, ``finetune
    --plan``).""")
LONG_CONTEXT = Section("Long sequences", """
    Chunking that keeps the activations of the head and the MLPs bounded as rows get longer
    (docs/long_context.md).""")
OPTIMIZER = Section("Optimizer", """
    AdamW in fp32 -- on the host, or on a device for the layers the plan puts there -- with exact
    global-norm clipping.""")
DROPOUT = Section("Dropout", """
    The model's own dropout, drawn so that a step's masks do not depend on thread timing or the
    number of devices.""")
REPLICAS = Section("Data-parallel replicas", """
    Several processes under torchrun, each replica training its share of every global batch
    (docs/replicas.md).""")
FAULTS = Section("Faults and diagnostics", """
    What a NaN/inf or a stalled task does, and what the engine records to find out why.""")
TUNING = Section("Runtime tuning", """
    Buffers, threads and pinning the engine sizes for itself; change them when a measurement says
    so.""")


@dataclass
class Config:
    """How the engine trains: the user's settings, in sections.

    Every field is documented where it is declared (``setting(default, SECTION, doc)``, see
    :mod:`tinypipe.documented`); ``docs/configuration.md`` is generated from those declarations
    (``python -m tinypipe.config_reference``) and the list below is appended from them too. Give
    the fields as keywords (``devices`` may also come first); every value is checked when the
    object is made (:meth:`validate`: one-line :class:`ConfigError`). ``engine.config`` is what the
    user gave; ``engine.plan`` is what runs.
    """

    devices: Sequence[str] = setting(("cpu",), DEVICES, """
        The devices that train: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. Several CUDA devices run the
        model's packs as a pipeline (Tiny-Pipe's rotation, docs/several_gpus.md). A string is split
        at its commas (``"cuda:0,cuda:1"``).""")
    _: KW_ONLY
    precision: Precision = setting("fp32", DEVICES, """
        Compute precision of the forward and backward passes: ``"bf16"`` (for CUDA) or ``"fp32"``
        (exact mode). The master weights, gradient accumulators and AdamW moments stay fp32
        either way.""")
    compile_blocks: str = setting("auto", DEVICES, """
        ``"auto"`` runs the decoder blocks through torch.compile (Inductor) on CUDA and eager on
        CPU; ``"off"`` always eager; any other value names a torch.compile backend (e.g.
        ``"aot_eager"``). Compiled blocks are ~25% faster on an H200; the first step pays a
        one-off compile (~15 s for a Llama block).""")

    seq_len: int | None = setting(None, WORKLOAD, """
        Tokens per sequence the plan is for (at least 2). Required, with ``global_batch``, for
        the automatic plan on CUDA devices.""")
    global_batch: int | None = setting(None, WORKLOAD, """
        Sequences per optimizer step the plan is for.""")

    gpu_memory_bytes: int | None = setting(None, BUDGETS, """
        Memory per device the plan must fit; a string such as ``"24GiB"`` is read as bytes.
        None: the device's capacity under any per-process cap, or its free memory if less; on
        CPU the available RAM.""")
    cpu_memory_bytes: int | None = setting(None, BUDGETS, """
        Host memory for training; a string such as ``"100GiB"`` is read as bytes. None: the
        available RAM plus what this process already holds.""")
    hardware: str | None = setting(None, BUDGETS, """
        Rates for the time model: a preset (``tinypipe plan --hardware list``) or a JSON file,
        e.g. one written by ``tinypipe profile``. None: guessed from the GPU's name.""")

    offload_dir: str | tuple[str, ...] | None = setting(None, SSD_TIER, """
        A directory on a fast local SSD for the training state that does not fit in host memory
        (``Plan.offload`` says which layers' masters, moments, retained gradients or frozen LoRA
        weights live there), or a list of directories, one per drive: the state is striped over
        them and their rates add up (one string is always one path; a list of one becomes that
        string, of several a tuple). The engine keeps one scratch file in each for the run
        (removed at exit; leftovers of killed runs are swept and reported); checkpoints stay the
        source of truth. With it and ``cpu_memory_bytes``, the planner chooses per layer and kind
        what goes there. None: everything stays in DRAM, and a plan with ``offload`` is
        refused.""")

    pack_size: int | Sequence[int] | None = setting(None, PLAN, """
        Decoder blocks per pack: an int for uniform packs or a list of sizes (uneven packs,
        summing to the block count). Bigger packs: fewer pipeline bubbles and fewer boundary
        stashes, more device memory (every layer of a pack is resident at once).""")
    micro_batch_size: int | None = setting(None, PLAN, """
        Sequences per micro-batch in the forward pass. Bigger: faster kernels, more activation
        memory. It need divide nothing: the last micro-batch may be smaller.""")
    backward_micro_batch_size: int | None = setting(None, PLAN, """
        Sequences per micro-batch in the backward pass (the recompute and the backward). None:
        the forward's.""")
    prefetch_window: int | None = setting(None, PLAN, """
        How many layers are uploaded ahead of the one computing. 0 means no overlap of upload and
        compute; 1-2 is enough when compute per layer exceeds its upload.""")
    stash: StashPlace | Sequence[StashPlace] | None = setting(None, PLAN, """
        Where each pack's input is kept between forward and backward: on the device
        (``"device"``: fast, costs device memory) or in host memory (``"host"``: costs link
        bandwidth). A list gives it per pack boundary.""")
    device_optimizer: DeviceOptimizer | None = setting(None, PLAN, """
        ``"embed"``, ``"head"`` or ``"both"`` keep the fp32 master weights and AdamW moments of the
        embedding and/or head on their device (12 bytes per parameter of device memory) and step
        them there: their weights and gradients stop crossing the link, and the embedding's
        update no longer trails the backward on the host. ``"off"``: host AdamW.""")
    resident_packs: int | None = setting(None, PLAN, """
        The first N packs stay on their device for the whole run (loaded once, never swapped)
        with their AdamW state there (2 + 4 + 12 bytes per parameter of device memory): no
        upload, download or host AdamW for them -- host AdamW throughput and the link are what the
        rest of the model shares. The first packs' updates are also the last the backward
        produces. Needs each of those packs' forward and backward on one device.""")
    keep_activations: bool | Sequence[bool] | None = setting(None, PLAN, """
        ``True`` keeps the autograd activations of every pack that can keep them (every pack
        whose forward and backward share a device; over a QLoRA base only the resident packs and
        the last one) on the device from its forward to its backward, so that pack is not
        recomputed: one forward of its FLOPs less per step, its activations (every micro-batch of
        the step; matmul and attention outputs only, models/compact.py, unless the blocks draw
        dropout masks) held on the device meanwhile. A list gives it per pack. Needs the backward
        micro-batch to be a multiple of the forward one. ``False``: every pack is recomputed (the
        stash only).""")
    turn_packs: int | None = setting(None, PLAN, """
        The last N packs run a micro-batch-wise turn: each forward micro-batch goes through them,
        the head and back through their backward while their weights stay on the device, so each
        keeps (and holds) one micro-batch's activations instead of the step's, at the price of all
        their weights and gradient accumulators on the device at once. Needs them and the head on
        one device.""")
    assist_updates: bool = setting(True, PLAN, """
        True lets the planner move the AdamW updates of some host-stepped layers to the GPU
        (``Plan.assisted``, :mod:`tinypipe.runtime.optim.assist`) when the host's pass is what the
        step waits for: their fp32 master and moments go up, are stepped there and come back
        (12 B/param each way) -- right after the layer's backward without clipping, or at its first
        upload of the next step when clipping made the update wait for the global norm (the
        retained gradient goes up too) -- while the host steps the others. False: the host steps
        every layer that is not resident on a device.""")

    head_chunk_tokens: int | None = setting(None, LONG_CONTEXT, """
        Tokens per chunk of the fused head (final norm, LM head and loss, forward and backward).
        None: chosen from the vocabulary so one chunk's logits stay near 512 MiB. Logits for a
        whole batch are never materialised.""")
    mlp_chunk_tokens: int | None = setting(None, LONG_CONTEXT, """
        Run each decoder block's MLP over at most this many tokens at a time
        (:mod:`tinypipe.models.chunked_mlp`): at long sequences the MLP's intermediates, not the
        weights, overflow the GPU (Llama-3.1-8B shape, 64K tokens: 1.75 GiB each for gate, up and
        activation). A micro-batch of at most that many tokens runs unchunked, bit for bit as
        before; a longer one costs one more MLP forward per chunk in its backward (each chunk is
        recomputed there). None: automatic -- off for ``seq_len`` up to 16384 tokens (or unset),
        else the power of two that keeps one intermediate near 256 MiB (8192 tokens for the 8B
        shape in bf16). 0: never chunk. Blocks without an ``mlp`` module (OPT) are not
        chunked. For Llama, Mistral, Qwen2 and Qwen3 the blocks' norms run inside the chunks too
        (one more norm and q/k/v forward per chunked block in the backward).""")
    document_tokens: int | None = setting(None, LONG_CONTEXT, """
        The documents packed into each sequence, for the planner's time model: their token-weighted
        mean length (sum of squared lengths / sum of lengths). Each document attends only within
        itself, so attention's FLOPs scale with it, not with ``seq_len`` (a 32K sequence of eight
        4K documents attends 8x less than one 32K document). None: one document per sequence.
        Changes predictions and so the plan chosen, never what is computed.""")
    segment_attention: bool | None = setting(None, LONG_CONTEXT, """
        Attend within each packed document (and sliding window) without transformers' dense
        ``[B, 1, S, S]`` mask (:mod:`tinypipe.models.segment_attention`): 16 GiB per 128K-token
        row, on every device. None: automatic -- on for ``seq_len`` above 16384 tokens (off when
        unset), so short runs compute bit for bit what they did; True/False: always/never.
        Honoured for Llama, Mistral, Qwen2 and Qwen3 with SDPA attention; other models keep the
        mask.""")

    attention_tile_tokens: int | None = setting(None, LONG_CONTEXT, """
        Under segment attention, a document (or row) longer than this many tokens attends in
        tiles of this many queries x keys through the fused kernel's own forward and backward
        (:mod:`tinypipe.models.tiled_attention`): the whole-segment backward allocates about seven
        rows of the query width per token (14 GiB at 256K tokens of the Llama-3.1-8B shape), the
        tiled one about three plus one tile's temporaries. Exact: the tiles' softmaxes are merged
        by their log-sum-exp. None: the planner's choice among 8192, 16384 and 32768 (the
        fastest plan that fits: larger tiles merge less and hold more), 8192 for a hand-set plan;
        0: whole segments. Used where a tile kernel passes its
        check on the device (cuDNN or flash attention in bf16/fp16 on CUDA, SDPA's own pick first;
        the CPU flash kernel) and attention has no dropout; elsewhere segments attend whole.""")

    lr: float = setting(1e-5, OPTIMIZER, """
        AdamW's learning rate; ``engine.step(batch, lr=...)`` overrides it for one step (the
        training loop's schedule does).""")
    betas: tuple[float, float] = setting((0.9, 0.999), OPTIMIZER, """
        AdamW's moment decay rates, two numbers in [0, 1).""")
    eps: float = setting(1e-8, OPTIMIZER, """
        AdamW's denominator term, > 0.""")
    weight_decay: float = setting(0.0, OPTIMIZER, """
        AdamW's decoupled weight decay, applied as Hugging Face Trainer applies it: not to biases
        and normalization weights (LayerNorm/RMSNorm, any parameter whose name says ``norm``; see
        :mod:`tinypipe.runtime.optim.decay`), to everything else, embeddings and the output
        embedding included. Checkpoints record the grouping; loading one made with another
        grouping is refused.""")
    decay_all: bool = setting(False, OPTIMIZER, """
        True decays every parameter, as plain ``torch.optim.AdamW(model.parameters())`` does.""")
    max_grad_norm: float | None = setting(None, OPTIMIZER, """
        Clip the global gradient norm to this, exactly. Layers are stepped as their gradients
        arrive, speculating that clipping will not trigger; when it does, those steps are undone
        from the retained gradients and redone clipped (:mod:`tinypipe.runtime.optim.decisions`).
        Retaining the gradients costs 4 bytes per parameter of host memory. None: no
        clipping.""")

    dropout: bool = setting(True, DROPOUT, """
        Train with the model's own dropout (``True``, as Hugging Face's Trainer does: modules in
        training mode, so GPT-2's ``attn_pdrop``/``resid_pdrop``/``embd_pdrop``, PEFT's
        ``lora_dropout`` and the like apply); ``False`` runs every module in eval mode. The
        backward recompute draws the forward's masks exactly (see :mod:`tinypipe.runtime.rng`).
        Models without dropout train identically either way.""")
    dropout_seed: int | None = setting(None, DROPOUT, """
        The masks are a function of this seed, the step count, the pack and the forward
        micro-batch (not of thread timing or the number of devices). None: drawn from torch's
        global generator when the engine is built (``torch.manual_seed`` first to repeat).""")

    optimizer_sharding: OptimizerShardingChoice = setting("auto", REPLICAS, """
        With data-parallel replicas (torchrun), whether each replica keeps the whole host AdamW
        state (``"replicate"``) or only its 1/R shard (``"shard"``: less host memory, one
        all-gather of the updated weights per layer); ``"auto"``: the planner chooses.""")

    nonfinite: NonFinitePolicy = setting("raise", FAULTS, """
        A NaN/inf loss or gradient: ``"raise"`` stops with NonFiniteError; ``"skip"`` drops the
        step and leaves weights and AdamW state bit-identical. To make that exact, every layer's
        update waits for the end of the backward (as under clipping; it then overlaps the next
        step's forward): measured on W1 (3B, H200) ~2.9 s/step instead of ~2.0 s.

        Under ``"raise"`` a non-finite loss is seen before any layer is updated; a non-finite
        gradient is seen when its layer's turn comes, after the layers before it in the backward
        were stepped (speculatively, overlapped with the backward). With retained gradients
        (``max_grad_norm`` set) those steps are undone algebraically (within float rounding) and
        the engine can go on. Without them (the default: retaining would cost 4 bytes/parameter
        of host memory, deferring every update ~45% of step time, for an event that ends the run
        anyway) nothing can undo them: the error names the layers that kept the update, and the
        engine refuses further steps and checkpoints -- it never continues from, or saves, a
        state that mixes two steps -- until ``load_checkpoint`` restores a consistent one.""")
    check_finite: bool = setting(False, FAULTS, """
        Stop at the first task whose output holds a NaN/inf, naming it (each task's output is
        checked, which synchronizes: for finding where a NaN starts, not for training).""")
    stall_timeout_s: float = setting(300.0, FAULTS, """
        When no task of a step has finished for this many seconds, the watchdog aborts the step
        with one line naming what was waiting (a hung device or transfer), instead of hanging
        forever.""")
    trace: bool = setting(False, FAULTS, """
        Record CUDA timing events per task: ``engine.step_timeline()`` and
        ``engine.export_trace(path)`` (Chrome/Perfetto) then show device times, not host times.
        Costs a little per task.""")

    pin_memory: PinMode = setting("register", TUNING, """
        ``"register"`` page-locks the host master weights in place (fast DMA, no copy, no
        power-of-two rounding); ``"pageable"`` leaves them pageable (slower transfers, nothing
        locked). Ignored on CPU devices.""")
    grad_slots: int | None = setting(None, TUNING, """
        Gradient accumulators per device (``Plan.grad_slots``). None: enough for a pack to
        accumulate while the pack before it on that device still downloads, so no backward waits
        for a download (``Plan.grad_slot_count``).""")
    host_grad_buffers: int | None = setting(None, TUNING, """
        Host buffers per device that gradient chunks download into before the optimizer takes
        them. None: enough for two whole block layers in flight (at least 3); fewer made
        downloads wait for the optimizer (measured on W1: 8% of throughput).""")
    optimizer_threads: int | None = setting(None, TUNING, """
        OpenMP threads of the host optimizer lane. None: with CUDA devices, the cores less one
        per device and one more (left to the lanes that feed the GPUs); on CPU, torch's
        default.""")
    extra: dict = setting(MISSING, TUNING, """
        Named knobs that are not settings of their own yet, read where they apply:
        ``"ssd_read_ahead"`` (layers of SSD-tier state read ahead, default 2), and for replicas
        ``"dp_share_devices"``, ``"dp_timeout_s"``, ``"dp_heartbeat_s"`` and ``"dp_single_rank"``
        (:func:`tinypipe.runtime.replica_setup.join_replicas`).""", default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.devices, str):  # "cuda:0" or "cuda:0,cuda:1"
            self.devices = tuple(d.strip() for d in self.devices.split(",") if d.strip())
        if not isinstance(self.devices, (list, tuple)) or not all(isinstance(d, str) for d in self.devices):
            raise ConfigError(f"devices must be a list of device names like ['cuda:0'], got {self.devices!r}")
        self.devices = tuple(self.devices)
        if not isinstance(self.betas, (list, tuple)) or not all(_is_number(b) for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        for name in ("lr", "eps", "weight_decay", "max_grad_norm", "stall_timeout_s"):
            value = getattr(self, name)
            if not (value is None and name == "max_grad_norm") and not _is_number(value):
                raise ConfigError(f"{name} must be a number, got {value!r}")
        if self.stash is not None and not isinstance(self.stash, str) and not (
            isinstance(self.stash, (list, tuple)) and all(isinstance(x, str) for x in self.stash)
        ):
            raise ConfigError(f"stash must be one of {', '.join(STASH_PLACES)} or a list of them, "
                              f"got {self.stash!r}")
        if not isinstance(self.decay_all, bool):
            raise ConfigError(f"decay_all must be true or false, got {self.decay_all!r}")
        for name in ("precision", "pin_memory", "nonfinite", "compile_blocks"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in ("gpu_memory_bytes", "cpu_memory_bytes"):  # "24GiB" as well as bytes
            if isinstance(getattr(self, name), str):
                setattr(self, name, parse_bytes(getattr(self, name)))
        if self.offload_dir is not None:  # one path, or several (one per drive): a tuple of 2+
            given = self.offload_dir
            if not isinstance(given, (str, os.PathLike, list, tuple)):
                raise ConfigError(f"offload_dir must be a directory path or a list of them, got {given!r}")
            try:  # the storage layer's own check, the one the SSD store and --offload-dir run
                dirs = as_directories(given)
            except StorageError as exc:
                raise ConfigError(f"offload_dir must be a directory path or a list of them: {exc}") from None
            self.offload_dir = dirs[0] if len(dirs) == 1 else tuple(dirs)
        for flag in ("dropout", "assist_updates"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.hardware is not None and not isinstance(self.hardware, str):
            raise ConfigError(f"hardware must be a preset name or a file path, got {self.hardware!r}")
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError (one line) for any value that cannot work."""
        if not self.devices:
            raise ConfigError("devices: give at least one device, e.g. ['cuda:0'] or ['cpu']")
        for d in self.devices:
            if not (d == "cpu" or d == "cuda" or d.startswith("cuda:")):
                raise ConfigError(f"devices: unknown device {d!r}; use 'cpu' or 'cuda:N'")
        optional = ("micro_batch_size", "prefetch_window", "backward_micro_batch_size", "grad_slots",
                    "host_grad_buffers", "head_chunk_tokens", "mlp_chunk_tokens", "document_tokens",
                    "attention_tile_tokens",
                    "optimizer_threads", "seq_len", "global_batch", "gpu_memory_bytes", "cpu_memory_bytes",
                    "resident_packs", "dropout_seed")
        for name in optional:
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be a whole number, got {value!r}")
        if self.pack_size is not None and (
            isinstance(self.pack_size, bool) or not isinstance(self.pack_size, (int, list, tuple)) or (
                not isinstance(self.pack_size, int)
                and not all(isinstance(p, int) and not isinstance(p, bool) for p in self.pack_size))
        ):
            raise ConfigError(f"pack_size must be a whole number or a list of them, got {self.pack_size!r}")
        for name in ("seq_len", "global_batch", "gpu_memory_bytes", "cpu_memory_bytes", "document_tokens"):
            value = getattr(self, name)
            if value is not None and value < (2 if name == "seq_len" else 1):
                raise ConfigError(f"{name} must be >= {2 if name == 'seq_len' else 1}, got {value}")
        if self.resident_packs is not None and self.resident_packs < 0:
            raise ConfigError(f"resident_packs must be >= 0, got {self.resident_packs}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.backward_micro_batch_size is not None and self.backward_micro_batch_size < 1:
            raise ConfigError(
                f"backward_micro_batch_size must be >= 1, got {self.backward_micro_batch_size}"
            )
        if self.pack_size is None:
            pass
        elif isinstance(self.pack_size, int):
            if self.pack_size < 1:
                raise ConfigError(f"pack_size must be >= 1, got {self.pack_size}")
        else:
            self.pack_size = tuple(int(p) for p in self.pack_size)
            if not self.pack_size or min(self.pack_size) < 1:
                raise ConfigError(f"pack_size list must hold positive sizes, got {self.pack_size}")
        if self.prefetch_window is not None and self.prefetch_window < 0:
            raise ConfigError(f"prefetch_window must be >= 0, got {self.prefetch_window}")
        _check_choice("precision", self.precision, PRECISIONS)
        if not self.lr >= 0:
            raise ConfigError(f"lr must be >= 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ConfigError(f"eps must be > 0, got {self.eps}")
        if not self.weight_decay >= 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        stashes = () if self.stash is None else (
            (self.stash,) if isinstance(self.stash, str) else tuple(self.stash))
        for s in stashes:
            _check_choice("stash", s, STASH_PLACES)
        if self.stash is not None and not isinstance(self.stash, str):
            self.stash = tuple(self.stash)
        _check_choice("pin_memory", self.pin_memory, PIN_MODES)
        if self.head_chunk_tokens is not None and self.head_chunk_tokens < 1:
            raise ConfigError(f"head_chunk_tokens must be >= 1, got {self.head_chunk_tokens}")
        if self.mlp_chunk_tokens is not None and self.mlp_chunk_tokens < 0:
            raise ConfigError(f"mlp_chunk_tokens must be >= 0 (0: unchunked), got {self.mlp_chunk_tokens}")
        if self.attention_tile_tokens is not None and self.attention_tile_tokens < 0:
            raise ConfigError(f"attention_tile_tokens must be >= 0 (0: whole segments), "
                              f"got {self.attention_tile_tokens}")
        turn = self.turn_packs
        if turn is not None and (isinstance(turn, bool) or not isinstance(turn, int) or turn < 0):
            raise ConfigError(f"turn_packs must be a whole number >= 0, got {self.turn_packs!r}")
        if self.grad_slots is not None and self.grad_slots < 1:
            raise ConfigError(f"grad_slots must be >= 1, got {self.grad_slots}")
        if not self.compile_blocks or self.compile_blocks != self.compile_blocks.strip():
            raise ConfigError("compile_blocks must be 'auto', 'off' or a torch.compile backend name, "
                              f"got {self.compile_blocks!r}")
        keep = self.keep_activations
        if keep is not None and not isinstance(keep, bool):
            if not isinstance(keep, (list, tuple)) or not all(isinstance(k, bool) for k in keep):
                raise ConfigError(f"keep_activations must be true, false or a list of them (one per pack), "
                                  f"got {keep!r}")
            self.keep_activations = tuple(keep)
        if self.device_optimizer is not None:
            _check_choice("device_optimizer", self.device_optimizer, DEVICE_OPTIMIZER_CHOICES)
        _check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        _check_choice("optimizer_sharding", self.optimizer_sharding, OPTIMIZER_SHARDING_CHOICES)
        if not self.stall_timeout_s > 0:
            raise ConfigError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")
        if self.host_grad_buffers is not None and self.host_grad_buffers < 1:
            raise ConfigError(f"host_grad_buffers must be >= 1, got {self.host_grad_buffers}")

    @property
    def auto_plan(self) -> bool:
        """True when no packing knob is set: the engine plans them (see the class docstring)."""
        return all(getattr(self, k) is None for k in PLAN_KNOBS)

    def plan_settings(self) -> dict:
        """The hand-set plan: :data:`~tinypipe.schedule.plan.PLAN_SETTINGS` from these fields,
        unset ones at their defaults (backward micro-batch: the forward's) -- the keywords of
        :func:`~tinypipe.schedule.plan.make_plan`."""
        out = {name: getattr(self, name) for name in PLAN_SETTINGS}
        out.update({k: v for k, v in MANUAL_DEFAULTS.items() if out[k] is None})
        if out["backward_micro_batch_size"] is None:
            out["backward_micro_batch_size"] = out["micro_batch_size"]
        if out["keep_activations"] is False:  # make_plan's default: the plans of before the knob
            del out["keep_activations"]
        if not out["turn_packs"]:
            del out["turn_packs"]
        return out

    def replace(self, **changes: object) -> "Config":
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **changes)


Config.__doc__ = (Config.__doc__ or "").rstrip() + "\n" + fields_text(Config) + "\n"
