"""Hardware descriptions for the offline planner: GPU memory, link bandwidths, achieved compute
and the CPU optimizer's rate, as presets or from a JSON file.

Rates are *achieved* rates, not datasheet peaks: ``bf16_tflops`` is what Hugging Face eager
decoder blocks reach at 8192-token micro-batches (about half the dense-matmul peak; measured 400
TFLOP/s on an H200 whose 8192^3 matmul runs at ~800), ``cpu_adamw_gparams_s`` is torch's fused
CPU AdamW in G parameters per second on the whole machine.

A JSON file holds the same fields; memory may be given in bytes or as a size string::

    {"name": "my-box", "gpu_memory": "24GiB", "h2d_gbs": 24, "d2h_gbs": 24, "bidir_gbs": 40,
     "bf16_tflops": 80, "cpu_adamw_gparams_s": 2.5}

A file written by ``tinypipe profile`` (``"format": "tinypipe-profile"``) is read the same way; its
``layer_profile`` (measured per-layer forward/recompute/backward and head times over micro-batch
sizes and sequence lengths, :class:`~tinypipe.planner.layer_profile.LayerProfile`) then replaces the
FLOP-rate compute estimate in the cost model; its other measurement details are ignored here.
``tinypipe profile --offload-dir DIR`` also records ``ssd_read_gbps`` / ``ssd_write_gbps``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from tinypipe.errors import ConfigError
from tinypipe.planner.layer_profile import LayerProfile
from tinypipe.units import parse_bytes  # noqa: F401 - re-exported: tinypipe.planner.parse_bytes

PROFILE_FORMAT = "tinypipe-profile"

GiB = 1024**3
#: A typical single PCIe 4.0 x4 NVMe SSD under the tier's direct I/O (read, write GB/s): datasheets
#: quote ~7 / ~5-6 GB/s sequential; sustained writes past a consumer drive's SLC cache and mixed
#: traffic land lower, so the presets state 6 / 4 (a stated value, not a measurement).
TYPICAL_NVME_GEN4 = (6.0, 4.0)
#: The GPU machine's disk (H200 box), measured with O_DIRECT, 16 threads x 64 MiB requests.
H200_BOX_SSD = (1.6, 2.4)


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU type on its host link, and the host's CPU optimizer rate."""

    name: str
    gpu_memory_bytes: int
    h2d_gbs: float  # host -> device, pinned, GB/s
    d2h_gbs: float  # device -> host, pinned, GB/s
    bidir_gbs: float  # both directions at once, total GB/s
    bf16_tflops: float  # achieved by whole decoder blocks as the engine runs them (compiled on CUDA)
    cpu_adamw_gparams_s: float  # fused CPU AdamW, G params/s, whole machine
    fp32_tflops: float | None = None  # achieved in fp32 mode (default: bf16_tflops / 8)
    description: str = ""
    layer_profile: LayerProfile | None = None  # measured per-layer times (tinypipe profile)
    ssd_read_gbps: float | None = None  # the offload directory's direct-I/O read rate, GB/s
    ssd_write_gbps: float | None = None  # ... and write rate (None: unknown)
    #: read + written bytes per second with both in flight together (``tinypipe profile`` measures
    #: it); None: unknown, and a phase that reads and writes is planned at the serial time
    ssd_mixed_gbps: float | None = None
    #: host memory bandwidth the CPU and the DMA engines share, GB/s (None: unknown, no floor):
    #: the forward after a clipped step moves every host-held layer's AdamW state through it
    #: (:mod:`tinypipe.planner.dram`)
    host_dram_gbs: float | None = None
    #: device entries (pipeline stages) per GPU: >1 when a device list names one GPU several times
    stages_per_gpu: int = 1
    #: what the device entries are: "cuda", or "cpu" (tests: their pools and activations are host memory)
    device_kind: str = "cuda"

    def tflops(self, precision: str) -> float:
        if precision == "fp32":
            return self.fp32_tflops or self.bf16_tflops / 8
        return self.bf16_tflops

    def shared_by(self, entries: int) -> "HardwareSpec":
        """This GPU as one of ``entries`` pipeline stages that share it (``cuda:0,cuda:0``): each
        stage alone runs at the GPU's rates, and the time model adds that together they run on
        one GPU and one link (:attr:`stages_per_gpu`)."""
        return replace(self, name=f"{self.name} x{entries} stages", stages_per_gpu=entries)

    def with_memory(self, gpu_memory_bytes: int | None) -> "HardwareSpec":
        return self if gpu_memory_bytes is None else replace(self, gpu_memory_bytes=int(gpu_memory_bytes))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["layer_profile"] = self.layer_profile.as_dict() if self.layer_profile is not None else None
        return d


#: The presets' SSD (all but the H200 box, whose disk was measured): a typical NVMe Gen4 drive.
_GEN4 = dict(ssd_read_gbps=TYPICAL_NVME_GEN4[0], ssd_write_gbps=TYPICAL_NVME_GEN4[1])

HARDWARE: dict[str, HardwareSpec] = {
    h.name: h
    for h in (
        # bf16: 525 TFLOP/s fitted on one compiled-block run and checked on runs not fitted on
        # (python bench/archive/fit_h200_rate.py); host DRAM: 155 GB/s shared by the host AdamW and
        # the DMA engines (planner/dram.py); both measured: docs/measured.md
        HardwareSpec("h200-pcie5", 140 * GiB, 55.5, 55.3, 101.0, 525.0, 4.1, fp32_tflops=35.0,
                     description="H200 on PCIe 5.0 x16, 16-core host (measured here, compiled blocks; "
                                 "its disk and host memory too)",
                     ssd_read_gbps=H200_BOX_SSD[0], ssd_write_gbps=H200_BOX_SSD[1], host_dram_gbs=155.0),
        HardwareSpec("rtx4090-pcie4", 24 * GiB, 25.0, 25.0, 45.0, 90.0, 2.0, fp32_tflops=40.0,
                     description="RTX 4090 on PCIe 4.0 x16, desktop/workstation CPU", **_GEN4),
        HardwareSpec("rtx3090-pcie4", 24 * GiB, 22.0, 22.0, 38.0, 35.0, 2.0, fp32_tflops=18.0,
                     description="RTX 3090 on PCIe 4.0 x16 (Tiny-Pipe's artifact box saw ~16 GB/s)", **_GEN4),
        HardwareSpec("a5000", 24 * GiB, 22.0, 22.0, 38.0, 50.0, 2.5, fp32_tflops=14.0,
                     description="RTX A5000 on PCIe 4.0 x16, workstation CPU", **_GEN4),
        HardwareSpec("l40s", 45 * GiB, 25.0, 25.0, 45.0, 170.0, 3.0, fp32_tflops=45.0,
                     description="L40S (48 GB, 45 GiB usable) on PCIe 4.0 x16, server CPU", **_GEN4),
        HardwareSpec("a100-40g-pcie4", 40 * GiB, 24.0, 24.0, 45.0, 150.0, 3.0, fp32_tflops=10.0,
                     description="A100 40 GB PCIe on PCIe 4.0 x16, server CPU", **_GEN4),
    )
}

_OPTIONAL = ("fp32_tflops", "description", "layer_profile", "ssd_read_gbps", "ssd_write_gbps",
             "ssd_mixed_gbps", "host_dram_gbs", "stages_per_gpu", "device_kind")


def spec_from_dict(d: dict, default_name: str) -> HardwareSpec:
    """A :class:`HardwareSpec` from a hardware file's or ``tinypipe profile``'s JSON (named
    ``default_name`` where it names nothing). A profile keeps only the planner's fields; any other
    file with an unknown or missing field is a one-line :class:`ConfigError`, not a silent guess."""
    known = {f.name for f in fields(HardwareSpec)}
    d = dict(d)
    if d.get("format") == PROFILE_FORMAT:  # tinypipe profile output: keep the planner's fields
        saved = [p.get("act_saved_bytes_per_token") for p in d.get("points", []) if isinstance(p, dict)]
        saved = [float(x) for x in saved if x]
        d = {k: v for k, v in d.items() if k in known}
        if (saved and isinstance(d.get("layer_profile"), dict)
                and not d["layer_profile"].get("act_bytes_per_token")):
            d["layer_profile"] = dict(d["layer_profile"], act_bytes_per_token=max(saved))
    prof = d.pop("layer_profile", None)
    if prof is not None:
        try:
            d["layer_profile"] = LayerProfile.from_dict(prof)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"hardware file: bad layer_profile ({exc})") from None
    if "gpu_memory" in d and "gpu_memory_bytes" not in d:
        d["gpu_memory_bytes"] = d.pop("gpu_memory")
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"hardware file: unknown field(s) {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(known))}")
    d.setdefault("name", default_name)
    missing = [f.name for f in fields(HardwareSpec)
               if f.name not in d and f.name not in _OPTIONAL]
    if missing:
        raise ConfigError(f"hardware file: missing field(s) {', '.join(missing)}")
    try:
        d["gpu_memory_bytes"] = parse_bytes(d["gpu_memory_bytes"])
        for k in ("h2d_gbs", "d2h_gbs", "bidir_gbs", "bf16_tflops", "cpu_adamw_gparams_s"):
            d[k] = float(d[k])
            if not d[k] > 0:
                raise ConfigError(f"hardware file: {k} must be > 0, got {d[k]}")
        for k in ("fp32_tflops", "ssd_read_gbps", "ssd_write_gbps", "ssd_mixed_gbps", "host_dram_gbs"):
            if d.get(k) is not None:
                d[k] = float(d[k])
                if not d[k] > 0:
                    raise ConfigError(f"hardware file: {k} must be > 0, got {d[k]}")
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"hardware file: {exc}") from None
    return HardwareSpec(**d)


def load_hardware(spec: str | HardwareSpec) -> HardwareSpec:
    """A preset name (case-insensitive) or a JSON file path -> :class:`HardwareSpec`."""
    if isinstance(spec, HardwareSpec):
        return spec
    key = str(spec).strip().lower()
    if key in HARDWARE:
        return HARDWARE[key]
    path = Path(str(spec)).expanduser()
    if path.is_file():
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read hardware file {path}: {exc}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"hardware file {path}: expected a JSON object")
        return spec_from_dict(d, path.stem)
    raise ConfigError(f"unknown hardware {spec!r}; presets: {', '.join(HARDWARE)} (or a JSON file)")


#: Links data-parallel replicas reduce gradients over (``tinypipe plan --interconnect``), GB/s per
#: direction as a ring collective sees it (its *bus* bandwidth): stated values, not measured here --
#: give a measured number (nccl-tests ``busbw``) where you have one.
INTERCONNECTS: dict[str, float] = {
    # within a node, GPU to GPU
    # PCIe 4.0 x16: 32 GB/s raw per direction; GPU-to-GPU through the root complex reaches about what
    # the host link does (the PCIe 4 presets' 22-25 GB/s)
    "pcie4": 22.0,
    # PCIe 5.0 x16: 64 GB/s raw; 50 = 90 % of the 55.5 GB/s host link measured on the H200 box (the
    # h200-pcie5 preset): peer traffic crosses the same root complex
    "pcie5": 50.0,
    # NVLink 4 (H100/H200 SXM): 450 GB/s per direction per GPU (NVIDIA: 900 GB/s bidirectional);
    # 360 = 80 % of it, about what NCCL's all-reduce bus bandwidth reaches on an 8-GPU NVSwitch box
    "nvlink": 360.0,
    # between nodes: line rate (Gb/s / 8) x 0.9 for the protocol overhead (RoCE / InfiniBand reach
    # about this in nccl-tests; NCCL over plain TCP sockets often less -- measure and pass GB/s)
    "eth25": 25 / 8 * 0.9,
    "eth100": 100 / 8 * 0.9,
    "ib200": 200 / 8 * 0.9,  # InfiniBand HDR
    "ib400": 400 / 8 * 0.9,  # InfiniBand NDR
}
#: The presets that connect GPUs inside one node (the others connect nodes).
NODE_LINKS = ("pcie4", "pcie5", "nvlink")


def interconnect_gbs(spec: str | float) -> float:
    """A link preset name (:data:`INTERCONNECTS`, case-insensitive) or a number in GB/s -> GB/s."""
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        value = float(spec)
    else:
        key = str(spec).strip().lower()
        if key in INTERCONNECTS:
            return INTERCONNECTS[key]
        try:
            value = float(key.removesuffix("gb/s").removesuffix("gbs").strip())
        except ValueError:
            raise ConfigError(f"unknown interconnect {spec!r}; presets: {', '.join(INTERCONNECTS)} "
                              "(or a number in GB/s)") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError(f"interconnect bandwidth must be a positive number of GB/s, got {spec!r}")
    return value


def node_link_for(hw: HardwareSpec) -> str:
    """The GPU-to-GPU link inside a node to assume for ``hw`` when none is given: its PCIe generation."""
    return "pcie5" if "pcie5" in hw.name or "h200" in hw.name else "pcie4"
