"""A plan: the packing, micro-batching, placement and prefetch decisions one schedule realises."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Literal, Sequence, get_args

from tinypipe.errors import ConfigError

#: Which resident layers keep their AdamW state on their device and are stepped there.
DeviceOptimizer = Literal["off", "embed", "head", "both"]
DEVICE_OPTIMIZER_CHOICES: tuple[DeviceOptimizer, ...] = get_args(DeviceOptimizer)
#: Where a pack's input waits between its forward and its backward.
StashPlace = Literal["device", "host"]
STASH_PLACES: tuple[StashPlace, ...] = get_args(StashPlace)
#: Kinds of per-layer training state that can live on the SSD (``Plan.offload``): the fp32 master
#: weights, the two AdamW moments together, the retained fp32 gradient (only with clipping or
#: ``nonfinite="skip"``) and a LoRA layer's frozen base weights.
OffloadKind = Literal["master", "moments", "grad", "frozen"]
OFFLOAD_KINDS: tuple[OffloadKind, ...] = get_args(OffloadKind)
#: How data-parallel replicas (``Plan.replicas > 1``, one per torch.distributed rank group) hold the
#: host AdamW state: every replica all of it, or each only its 1/R shard of every layer
#: (reduce-scatter -> step the shard -> all-gather the updated weights).
OptimizerSharding = Literal["replicate", "shard"]
OPTIMIZER_SHARDINGS: tuple[OptimizerSharding, ...] = get_args(OptimizerSharding)
#: The settings :func:`make_plan` takes besides the model's shape and the device count: the same
#: names as the :class:`tinypipe.Config` fields that set them (:meth:`Plan.settings` gives them back).
PLAN_SETTINGS = ("pack_size", "micro_batch_size", "backward_micro_batch_size", "prefetch_window", "stash",
                 "grad_slots", "device_optimizer", "resident_packs", "keep_activations", "turn_packs")
#: Plan JSON keys written by older versions -> today's field names (:meth:`Plan.from_json`).
#: ``Plan.describe(on=...)`` for a plan run on CPU devices ("stepped on the GPU" would be untrue there).
CPU_DEVICE = "the device (cpu)"
_RENAMED_KEYS = {"fwd_micro_batch": "micro_batch_size", "bwd_micro_batch": "backward_micro_batch_size"}


@dataclass(frozen=True)
class Plan:
    """Decisions for one training step, independent of any model object.

    ``packs`` hold block indices (0-based). Pack ``q``'s forward runs on ``fwd_device[q]`` and its
    backward on ``bwd_device[q]``; the embedding and head are special packs with resident buffers
    on ``embed_device`` / ``head_device``. ``stash_on_host[q]`` says whether the input of pack
    ``q`` (``q == len(packs)``: the head's input) is kept in host memory instead of on the device.
    """

    packs: tuple[tuple[int, ...], ...]
    micro_batch_size: int
    backward_micro_batch_size: int
    num_devices: int = 1
    prefetch_window: int = 1
    stash_on_host: tuple[bool, ...] = ()
    fwd_device: tuple[int, ...] = ()
    bwd_device: tuple[int, ...] = ()
    embed_device: int = 0
    head_device: int = 0
    grad_slots: int | None = None
    device_optimizer: DeviceOptimizer = "off"  # resident layers stepped on their device
    resident_packs: int = 0  # the first packs stay on their device, stepped there (never swapped)
    # (layer id, kind) pairs whose state lives on the SSD (sorted; layer 0 = embedding, b + 1 = block
    # b, num_blocks + 1 = head); needs Config.offload_dir
    offload: tuple[tuple[int, str], ...] = ()
    # data-parallel replicas of this pipeline (torch.distributed), each training 1/replicas of the
    # global batch, and how they hold the host optimizer state
    replicas: int = 1
    optimizer_sharding: OptimizerSharding = "replicate"
    # per pack: its forward's autograd graph is kept on the device for its backward (empty: none)
    keep_activations: tuple[bool, ...] = ()
    # per pack (kept ones only): its graph's saved activations go down to host memory as the
    # forward makes them and come back up before its backward (runtime/host_kept.py; empty: none)
    kept_on_host: tuple[bool, ...] = ()
    # host-stepped layers (ids as in ``offload``) whose AdamW update runs on their device instead:
    # right after their backward, or -- when the update waits for the global norm (clipping) -- at
    # their first upload of the next step (runtime/optim/assist.py)
    assisted: tuple[int, ...] = ()
    # the last ``turn_packs`` packs run micro-batch-wise (schedule/builder.py): each forward
    # micro-batch goes through them, the head and back through their backward while their weights
    # stay in their slots, so each holds one micro-batch's graph at a time (all keep activations)
    turn_packs: int = 0
    # host-stepped layers (ids as in ``offload``) whose AdamW update always waits for the step's end
    # and runs during the next step's forward, before their upload there (their gradient kept in
    # host memory meanwhile): the host is idle in the forward, and the last packs' layers -- a
    # turn's -- are uploaded last
    deferred: tuple[int, ...] = ()
    # pack boundaries (1..P-1, sorted) whose host stash lives in the offload directory's files
    # instead of host memory (runtime/ssd_stash.py; long sequences with host memory short)
    stash_on_ssd: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.device_optimizer not in DEVICE_OPTIMIZER_CHOICES:
            raise ConfigError(f"plan: device_optimizer must be one of {', '.join(DEVICE_OPTIMIZER_CHOICES)}, "
                              f"got {self.device_optimizer!r}")
        if not 0 <= self.resident_packs <= len(self.packs):
            raise ConfigError(f"plan: resident_packs must be in 0..{len(self.packs)}, "
                              f"got {self.resident_packs}")
        for q in range(self.resident_packs):
            if self.fwd_device and self.fwd_device[q] != self.bwd_device[q]:
                raise ConfigError(f"plan: resident pack {q} runs its forward on device {self.fwd_device[q]} "
                                  f"and its backward on device {self.bwd_device[q]}; a resident pack needs "
                                  "one device")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ConfigError(f"plan: replicas must be a positive integer, got {self.replicas!r}")
        if self.optimizer_sharding not in OPTIMIZER_SHARDINGS:
            raise ConfigError(f"plan: optimizer_sharding must be one of {', '.join(OPTIMIZER_SHARDINGS)}, "
                              f"got {self.optimizer_sharding!r}")
        object.__setattr__(self, "offload", self._checked_offload())
        object.__setattr__(self, "keep_activations", self._checked_keep())
        object.__setattr__(self, "kept_on_host", self._checked_on_host())
        object.__setattr__(self, "assisted", self._checked_assisted())
        object.__setattr__(self, "deferred", self._checked_deferred())
        self._check_turn()
        object.__setattr__(self, "stash_on_ssd", self._checked_stash_on_ssd())

    def _checked_stash_on_ssd(self) -> tuple[int, ...]:
        """``stash_on_ssd`` sorted, unique, each the host-stashed input of a pack 1..P-1 that keeps
        no graph (not the embedding's output nor the head's input); ConfigError otherwise."""
        for q in self.stash_on_ssd:
            if isinstance(q, bool) or not isinstance(q, int) or not 0 < q < len(self.packs) or \
                    q >= len(self.stash_on_host) or not self.stash_on_host[q] or self.kept(q):
                raise ConfigError(f"plan: stash_on_ssd boundary {q!r} must be the host-stashed input of "
                                  f"a pack 1..{len(self.packs) - 1} that keeps no activations")
        return tuple(sorted(set(self.stash_on_ssd)))

    def _checked_deferred(self) -> tuple[int, ...]:
        """``deferred`` sorted, without duplicates; ConfigError for a layer out of range, stepped on
        its device, assisted, with state on the SSD, or replicas (their shards' leftover work is the
        sharded path's)."""
        return self._host_stepped_layers("deferred", self.deferred, "deferred updates", "deferred",
                                         assisted=set(self.assisted))

    def _host_stepped_layers(self, field_name: str, values: tuple[int, ...], feature: str, verb: str,
                             assisted: set[int] | frozenset[int] = frozenset()) -> tuple[int, ...]:
        """``values`` (layer ids, as ``offload``'s) sorted and without duplicates, all stepped on the
        host by one pipeline: ConfigError naming ``field_name`` / ``feature`` otherwise."""
        layers = set()
        for layer in values:
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= self.num_blocks + 1:
                raise ConfigError(f"plan: {field_name} layers must be in 0..{self.num_blocks + 1}, "
                                  f"got {layer!r}")
            layers.add(layer)
        if not layers:
            return ()
        if self.replicas > 1:
            raise ConfigError(f"plan: {feature} are for one pipeline; replicas step their shards "
                              "on the host")
        stepped = set().union(*(self.device_optimized(d) for d in range(self.num_devices)))
        offloaded = {layer for layer, _ in self.offload}
        for bad, why in ((layers & stepped, "is stepped on its device"), (layers & assisted, "is assisted"),
                         (layers & offloaded, "has state on the SSD")):
            if bad:
                raise ConfigError(f"plan: layer {min(bad)} {why}: its update cannot be {verb}")
        return tuple(sorted(layers))

    def _check_turn(self) -> None:
        """ConfigError unless the turn's packs (the last ``turn_packs``) are streamed packs that keep
        their activations on the device, on the head's device: the head runs between their forward
        and their backward, one micro-batch at a time, and their graphs live on that device."""
        k, streamed = self.turn_packs, len(self.packs) - self.resident_packs
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= streamed:
            raise ConfigError(f"plan: turn_packs must be in 0..{streamed} (the packs after the resident "
                              f"ones), got {k!r}")
        for q in self.turn():
            if not self.kept(q) or self.on_host(q):
                raise ConfigError(f"plan: turn pack {q} must keep its activations on the device "
                                  "(keep_activations, not kept_on_host)")
            devices = {self._device(self.fwd_device, q), self._device(self.bwd_device, q), self.head_device}
            if len(devices) != 1:
                raise ConfigError(f"plan: turn pack {q} runs on devices {sorted(devices)} (forward, "
                                  "backward, head); the turn runs on one")

    def turn(self) -> range:
        """The packs of the micro-batch-wise turn (``turn_packs``), in forward order."""
        return range(len(self.packs) - self.turn_packs, len(self.packs))

    def turn_layers(self) -> int:
        """Blocks in the turn: their weights and gradient accumulators are all on the device at once."""
        return sum(len(self.packs[q]) for q in self.turn())

    def _checked_assisted(self) -> tuple[int, ...]:
        """``assisted`` sorted, without duplicates; ConfigError for a layer out of range, one
        stepped on its device or with state on the SSD, or replicas (each steps its shard of
        every layer, and its leftover work is the sharded path's: reduce, step, gather)."""
        return self._host_stepped_layers("assisted", self.assisted, "assisted updates", "assisted")

    def _checked_keep(self) -> tuple[bool, ...]:
        """``keep_activations`` as a tuple of bools, () when no pack keeps (so plans written before
        the field equal today's); ConfigError for a wrong length, a kept pack whose forward and
        backward run on two devices, or backward micro-batches that split forward ones."""
        keep = self._per_pack_flags("keep_activations", self.keep_activations)
        if not keep:
            return ()
        for q in (q for q, k in enumerate(keep) if k):
            if self.fwd_device and self.fwd_device[q] != self.bwd_device[q]:
                raise ConfigError(f"plan: pack {q} keeps its activations but runs its forward on device "
                                  f"{self.fwd_device[q]} and its backward on device {self.bwd_device[q]}")
        if self.backward_micro_batch_size % self.micro_batch_size:
            raise ConfigError(f"plan: kept activations need the backward micro-batch "
                              f"({self.backward_micro_batch_size}) to be a multiple of the forward one "
                              f"({self.micro_batch_size}): each forward graph is differentiated once, whole")
        return keep

    def _per_pack_flags(self, name: str, values: tuple[bool, ...]) -> tuple[bool, ...]:
        """``values`` as a tuple of one bool per pack, () when none is set; ConfigError otherwise."""
        flags = tuple(values)
        if not any(flags):
            return ()
        if len(flags) != len(self.packs) or not all(isinstance(k, bool) for k in flags):
            raise ConfigError(f"plan: {name} needs one true/false per pack ({len(self.packs)}), "
                              f"got {list(flags)}")
        return flags

    def kept(self, q: int) -> bool:
        """Whether pack ``q`` keeps its forward's autograd graph for its backward."""
        return bool(self.keep_activations) and self.keep_activations[q]

    def on_host(self, q: int) -> bool:
        """Whether kept pack ``q``'s saved activations wait in host memory for its backward."""
        return bool(self.kept_on_host) and self.kept_on_host[q]

    def _checked_on_host(self) -> tuple[bool, ...]:
        """``kept_on_host`` as a tuple of bools, () when none; ConfigError for a wrong length or a
        pack that does not keep its activations."""
        host = self._per_pack_flags("kept_on_host", self.kept_on_host)
        for q in (q for q, h in enumerate(host) if h):
            if not self.kept(q):
                raise ConfigError(f"plan: pack {q}'s activations go to host memory but the pack does not "
                                  "keep them (keep_activations)")
        return host

    def keepable_packs(self, streamed: bool = True) -> tuple[int, ...]:
        """Packs that can keep their activations: every pack whose forward and backward run on one
        device. A streamed pack's slots are refilled between its forward and its backward; its
        graph saves its weights by reference and re-reads them from the backward's buffers
        (runtime/weight_refs.py). ``streamed=False``: only :meth:`fixed_slot_packs` (a QLoRA base,
        whose kernels hold their 4-bit weights outside autograd's saved tensors)."""
        if not streamed:
            return self.fixed_slot_packs()
        return tuple(q for q in range(len(self.packs))
                     if self._device(self.fwd_device, q) == self._device(self.bwd_device, q))

    def fixed_slot_packs(self) -> tuple[int, ...]:
        """Packs whose weights stay in their device buffers, unchanged, from their forward to their
        backward: the resident packs, and the last pack when its forward and backward share a
        device (the schedule keeps its slots across the turn), or every pack of a micro-batch-wise
        turn (``turn_packs``)."""
        P, R = len(self.packs), self.resident_packs
        out = list(range(R))
        turn = list(self.turn())
        if turn:  # the turn's packs keep their slots from their forward to their backward
            out += turn
        elif P > R and self._device(self.fwd_device, P - 1) == self._device(self.bwd_device, P - 1):
            out.append(P - 1)
        return tuple(out)

    @staticmethod
    def _device(devices: tuple[int, ...], q: int) -> int:
        return devices[q] if devices else 0

    def _checked_offload(self) -> tuple[tuple[int, str], ...]:
        """``offload`` sorted and without duplicates; ConfigError for an unknown kind or layer, or a
        layer stepped on its device (its state lives there, never on the host or the SSD)."""
        pairs = set()
        for item in self.offload:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise ConfigError(f"plan: offload entries are (layer, kind) pairs, got {item!r}")
            layer, kind = item
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= self.num_blocks + 1:
                raise ConfigError(f"plan: offload layer must be in 0..{self.num_blocks + 1}, got {layer!r}")
            if kind not in OFFLOAD_KINDS:
                raise ConfigError(f"plan: offload kind must be one of {', '.join(OFFLOAD_KINDS)}, "
                                  f"got {kind!r}")
            pairs.add((layer, str(kind)))
        if pairs:
            stepped = set().union(*(self.device_optimized(d) for d in range(self.num_devices)))
            bad = sorted(layer for layer, _ in pairs if layer in stepped)
            if bad:
                raise ConfigError(f"plan: layer {bad[0]} is stepped on its device (device_optimizer / "
                                  "resident_packs): its state cannot be offloaded to the SSD")
        return tuple(sorted(pairs))

    def offloaded(self) -> dict[int, frozenset[str]]:
        """Layer -> the kinds of its state that live on the SSD (layers with none left out)."""
        out: dict[int, set[str]] = {}
        for layer, kind in self.offload:
            out.setdefault(layer, set()).add(kind)
        return {layer: frozenset(kinds) for layer, kinds in out.items()}

    @property
    def num_packs(self) -> int:
        return len(self.packs)

    @property
    def pack_size(self) -> int | tuple[int, ...]:
        """The packing as Config writes it: one size (uniform packs, a smaller one last) or the sizes."""
        sizes = tuple(len(p) for p in self.packs)
        if sizes and split_packs(self.num_blocks, sizes[0]) == self.packs:
            return sizes[0]
        return sizes

    @property
    def stash(self) -> StashPlace | tuple[StashPlace, ...]:
        """The stash placement as Config writes it: ``"device"``, ``"host"`` (every pack input that
        can be) or one place per pack input, the head's included."""
        host = self.stash_on_host
        if not any(host):
            return "device"
        if host == tuple(0 < q < self.num_packs for q in range(self.num_packs + 1)):
            return "host"
        return tuple("host" if h else "device" for h in host)

    def settings(self) -> dict:
        """The :data:`PLAN_SETTINGS` that rebuild this plan with :func:`make_plan` (with the
        round-robin placement) -- also the :class:`tinypipe.Config` fields that select it;
        ``grad_slots`` only when set, ``keep_activations`` only when a pack keeps them,
        ``turn_packs`` only when there is a turn."""
        out = {name: getattr(self, name) for name in PLAN_SETTINGS}
        if out["grad_slots"] is None:
            del out["grad_slots"]
        if not out["keep_activations"]:
            del out["keep_activations"]
        if not out["turn_packs"]:
            del out["turn_packs"]
        return out

    def describe(self, ssd_bytes: int | None = None, on: str = "the GPU") -> str:
        """One line: packing, micro-batches, window, stash, what stays on the device and what lives
        on the SSD (layers per kind; ``ssd_bytes``, when the caller knows the sizes, in brackets)
        -- every printed plan reads it. ``on`` names the device (a plan run on CPU devices passes
        ``CPU_DEVICE``: nothing is stepped on a GPU there)."""
        pack = self.pack_size
        pack_text = str(pack) if isinstance(pack, int) else "[" + ",".join(map(str, pack)) + "]"
        stash = self.stash
        if not isinstance(stash, str):
            hosts = sum(self.stash_on_host)
            stash = f"host x{hosts}, device x{len(self.stash_on_host) - hosts}"
        dopt, resident = self.device_optimizer, self.resident_packs
        packs = f"pack{'s' * (resident > 1)}"
        return (f"pack {pack_text}, micro-batch {self.micro_batch_size}/{self.backward_micro_batch_size} "
                f"(fwd/bwd), window {self.prefetch_window}, stash {stash}"
                + ("" if dopt == "off" else f", {dopt} stepped on {on}")
                + ("" if not resident else f", first {resident} {packs} resident on {on}")
                + self._describe_keep()
                + ("" if not self.assisted else f", {len(self.assisted)} layers' AdamW assisted on {on}")
                + ("" if not self.deferred else f", {len(self.deferred)} layers' AdamW deferred to the next "
                   "forward")
                + self._describe_offload(ssd_bytes)
                + ("" if not self.stash_on_ssd else
                   f", {len(self.stash_on_ssd)} pack input{'s' * (len(self.stash_on_ssd) > 1)} on the SSD "
                   f"({','.join(map(str, self.stash_on_ssd))})")
                + ("" if self.replicas == 1 else
                   f", {self.replicas} replicas (optimizer state "
                   f"{'sharded' if self.optimizer_sharding == 'shard' else 'replicated'})"))

    def _describe_keep(self) -> str:
        kept = [q for q in range(len(self.packs)) if self.kept(q)]
        if not kept:
            return ""
        host = [q for q in kept if self.on_host(q)]
        which = ",".join(map(str, kept))
        k = self.turn_packs
        return (f", activations kept (no recompute) for pack{'s' * (len(kept) > 1)} {which}"
                + ("" if not host else f" (in host memory: {','.join(map(str, host))})")
                + ("" if not k else f", micro-batch-wise turn through the last {k} pack{'s' * (k > 1)}"))

    def _describe_offload(self, ssd_bytes: int | None) -> str:
        if not self.offload:
            return ""
        order = ("moments", "grad", "master", "frozen")  # the order the planner spills them in
        counts = {kind: sum(1 for _, k in self.offload if k == kind) for kind in order}
        parts = [f"{kind} of {n} layer{'s' * (n != 1)}" if i == 0 else f"{kind} of {n}"
                 for i, (kind, n) in enumerate((k, n) for k, n in counts.items() if n)]
        size = "" if ssd_bytes is None else f" ({ssd_bytes / 2**30:.1f} GiB on SSD)"
        return ", offload: " + ", ".join(parts) + size

    @cached_property  # the planner's cost model asks millions of times per search; packs never change
    def num_blocks(self) -> int:
        return sum(len(p) for p in self.packs)

    def device_optimized(self, device: int) -> set[int]:
        """Layers (0: embedding, num_blocks + 1: head) whose AdamW state lives on ``device``."""
        out = set(self.resident_layers(device))
        if self.device_optimizer in ("embed", "both") and device == self.embed_device:
            out.add(0)
        if self.device_optimizer in ("head", "both") and device == self.head_device:
            out.add(self.num_blocks + 1)
        return out

    def resident_layers(self, device: int | None = None) -> list[int]:
        """Layer ids (block b is layer b + 1) of the resident packs (on ``device``, or on any)."""
        return [b + 1 for q in range(self.resident_packs) for b in self.packs[q]
                if device is None or (self.fwd_device[q] if self.fwd_device else 0) == device]

    def param_slots(self) -> int:
        """Layer slots per device: the largest pack (or the turn's blocks, which stay together)
        plus the prefetch window."""
        return max([len(p) for p in self.packs] + [self.turn_layers()]) + self.prefetch_window

    def grad_slot_count(self) -> int:
        """Gradient accumulators per device: enough for a pack to accumulate while the pack before
        it on that device (in backward order) still downloads, so no backward waits for a download.

        It was the largest pack + 1, which let a pack of 3 start only after 2 of the previous
        pack's 3 downloads: 8 % of a traced step went to waiting at the pack boundaries
        (docs/measured.md). Resident packs accumulate in their own buffers; ``grad_slots``
        overrides."""
        if self.grad_slots:
            return self.grad_slots
        need = max(len(p) for p in self.packs) + 1
        turn = set(self.turn())
        for dev in set(self.bwd_device):
            sizes = [len(self.packs[q]) for q in reversed(range(self.resident_packs, self.num_packs))
                     if self.bwd_device[q] == dev and q not in turn]
            if turn and self.bwd_device[self.num_packs - 1] == dev:  # the turn's blocks accumulate together
                sizes.insert(0, self.turn_layers())
            need = max([need] + sizes[:1] + [a + b for a, b in zip(sizes, sizes[1:])])
        return need

    def as_dict(self) -> dict:
        """Every field but ``extra`` (JSON-ready: tuples become lists when dumped)."""
        d = asdict(self)
        d.pop("extra")
        return d

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def from_json(text: str) -> "Plan":
        """A plan from :meth:`to_json`'s text, also as older versions wrote it (renamed keys)."""
        d = json.loads(text)
        for old, new in _RENAMED_KEYS.items():
            if old in d and new not in d:
                d[new] = d.pop(old)
        for key in ("packs",):
            d[key] = tuple(tuple(p) for p in d[key])
        for key in ("stash_on_host", "fwd_device", "bwd_device", "keep_activations", "kept_on_host",
                    "assisted", "deferred", "stash_on_ssd"):
            d[key] = tuple(d.get(key, ()))
        d["offload"] = tuple(tuple(p) for p in d.get("offload", ()))  # older files: nothing offloaded
        return Plan(**d)

    @staticmethod
    def load(path: str | Path) -> "Plan":
        return Plan.from_json(Path(path).read_text())


def split_packs(num_blocks: int, pack_size: int | Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Consecutive block packs from a uniform size (last pack may be smaller) or explicit sizes."""
    if isinstance(pack_size, int):
        sizes = [pack_size] * (num_blocks // pack_size)
        if num_blocks % pack_size:
            sizes.append(num_blocks % pack_size)
    else:
        sizes = list(pack_size)
        if sum(sizes) != num_blocks:
            raise ConfigError(f"pack sizes {sizes} sum to {sum(sizes)}, the model has {num_blocks} blocks")
    packs, start = [], 0
    for s in sizes:
        packs.append(tuple(range(start, start + s)))
        start += s
    return tuple(packs)


def round_robin_devices(num_packs: int, num_devices: int,
                        tied: bool) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """Tiny-Pipe placement: the execution sequence [embed, fwd packs, head, bwd packs] is dealt
    round-robin over the devices, so no device owns a fixed stage and backward continues the
    rotation in reverse. The embedding is resident on device 0 (its backward runs there too);
    a tied head shares the embedding's device so one resident copy serves both."""
    n = num_devices
    fwd = tuple((1 + q) % n for q in range(num_packs))
    head = 0 if tied else (1 + num_packs) % n
    bwd = tuple((2 + num_packs + (num_packs - 1 - q)) % n for q in range(num_packs))
    return fwd, bwd, 0, head


def make_plan(
    num_blocks: int,
    *,
    pack_size: int | Sequence[int],
    micro_batch_size: int,
    backward_micro_batch_size: int,
    num_devices: int,
    prefetch_window: int,
    stash: StashPlace | Sequence[StashPlace],
    tied: bool,
    grad_slots: int | None = None,
    device_optimizer: DeviceOptimizer = "off",
    resident_packs: int = 0,
    offload: Sequence[tuple[int, str]] = (),
    keep_activations: bool | Sequence[bool] = False,
    keep_streamed: bool = True,
    turn_packs: int = 0,
) -> Plan:
    """The default plan for hand-set knobs (what :class:`tinypipe.Config` describes).
    ``keep_activations``: True keeps them for every pack that can (:meth:`Plan.keepable_packs`,
    with ``keep_streamed``), a list says it per pack. ``turn_packs``: the last packs run a
    micro-batch-wise turn (:attr:`Plan.turn_packs`), which keeps their activations too."""
    packs = split_packs(num_blocks, pack_size)
    for s in (stash,) if isinstance(stash, str) else stash:
        if s not in STASH_PLACES:
            raise ConfigError(f"stash must be one of {', '.join(STASH_PLACES)}, got {s!r}")
    if isinstance(stash, str):
        # the head's input is consumed on the spot: never host-stashed; nor is the embedding's output
        # here (only at long sequences, where pack 1's input is: host_stashed_inputs)
        stash_host = tuple(stash == "host" and 0 < q < len(packs) for q in range(len(packs) + 1))
    else:
        stash_host = tuple(s == "host" for s in stash)
        if len(stash_host) != len(packs) + 1:
            raise ConfigError(f"stash list needs {len(packs) + 1} entries (one per pack input incl. the "
                              f"head), got {len(stash_host)}")
    if num_devices == 1:
        fwd, bwd, e, h = (0,) * len(packs), (0,) * len(packs), 0, 0
    else:
        fwd, bwd, e, h = round_robin_devices(len(packs), num_devices, tied)
    plan = Plan(
        packs=packs,
        micro_batch_size=micro_batch_size,
        backward_micro_batch_size=backward_micro_batch_size,
        num_devices=num_devices,
        prefetch_window=prefetch_window,
        stash_on_host=stash_host,
        fwd_device=fwd,
        bwd_device=bwd,
        embed_device=e,
        head_device=h,
        grad_slots=grad_slots,
        device_optimizer=device_optimizer,
        resident_packs=resident_packs,
        offload=tuple(tuple(p) for p in offload),  # type: ignore[misc]
    )
    if isinstance(turn_packs, bool) or not isinstance(turn_packs, int) or not 0 <= turn_packs <= len(packs):
        raise ConfigError(f"turn_packs must be in 0..{len(packs)}, got {turn_packs!r}")
    turn = range(len(packs) - turn_packs, len(packs))
    if keep_activations is False and not turn_packs:
        return plan
    if keep_activations is True:
        kept = set(plan.keepable_packs(keep_streamed))
        keep = tuple(q in kept for q in range(len(packs)))
    elif keep_activations is False:
        keep = (False,) * len(packs)
    elif isinstance(keep_activations, (list, tuple)):
        keep = tuple(keep_activations)
        if turn_packs and len(keep) == len(packs) and not all(keep[q] for q in turn):
            raise ConfigError(f"keep_activations {list(keep)} leaves out packs of the turn "
                              f"(turn_packs={turn_packs}: packs {turn.start}..{turn.stop - 1} keep theirs)")
    else:
        raise ConfigError(f"keep_activations must be true, false or one true/false per pack, "
                          f"got {keep_activations!r}")
    keep = tuple(k or q in turn for q, k in enumerate(keep))
    return replace(plan, keep_activations=keep, turn_packs=turn_packs)


def host_stashed_inputs(plan: Plan, long_sequences: bool) -> tuple[bool, ...]:
    """Per pack boundary ``q`` (0..P): whether pack ``q``'s input lives in host memory for the
    step -- ``stash_on_host[q]`` for ``q > 0``; for ``q == 0``, the embedding's output (the whole
    global batch, ``[batch, seq, hidden]``), only at long sequences (``long_sequences``: the MLPs
    run in chunks) and only where the plan puts the embedding on the host-stash path: the input
    after it, pack 1's, is stashed on the host (the planner stashes the first, longest-lived pack
    inputs there first; the embedding's output lives longer still: from the embedding's forward
    to pack 0's backward) and pack 0 does not keep its activations (a kept pack's graphs hold
    their inputs on the device; its backward reads no stash).

    Why only at long sequences: there the embedding's output is 2 GiB for two 128K-token rows of
    an 8B model, alive on the device the whole step, while a short run keeps what it did (the
    output adopted in place, no copy). The embedding's forward writes it down micro-batch by
    micro-batch through the stash's side streams, pack 0 reads it back as other packs read their
    stash; the embedding's backward recomputes its output and needs none of it."""
    P, stash = plan.num_packs, plan.stash_on_host
    host = tuple(0 < q < len(stash) and bool(stash[q]) for q in range(P + 1))
    embed = long_sequences and P > 1 and host[1] and not plan.kept(0)
    return (embed,) + host[1:]


def host_gradient_boundaries(plan: Plan, long_sequences: bool) -> tuple[bool, ...]:
    """Per pack boundary ``q`` (0..P): whether the gradient of pack ``q``'s input lives in host
    memory, in the rows of that input's host stash (:func:`host_stashed_inputs`) -- rows nothing
    reads once pack ``q``'s backward has recomputed from them -- instead of a ``[batch, seq,
    hidden]`` device buffer. Boundary 0's is the gradient the embedding's backward reads: one
    forward micro-batch's rows at a time.

    Why: at long sequences two such device buffers (the gradient a backward reads and the one it
    writes) are 2 GiB each for two 128K-token rows of an 8B model, and they hold the whole global
    batch; the copies to and from the host are small against a block's compute there. Only for
    long sequences (``long_sequences``: the MLPs run in chunks), so short runs keep what they did,
    and only where backward micro-batches are whole forward ones: a dropout replay reads the rest
    of its forward micro-batch's inputs, which an earlier backward micro-batch could have
    overwritten. (Those rows only shape the replay's draws -- no op mixes rows -- so this is
    caution, not a correctness need: a test that aliased them anyway saw identical weights.)"""
    P = plan.num_packs
    aligned = plan.backward_micro_batch_size % plan.micro_batch_size == 0
    on = long_sequences and aligned
    stashed = host_stashed_inputs(plan, long_sequences)
    return tuple(on and q < P and stashed[q] for q in range(P + 1))
