"""The SSD the planner plans for: its read/write rates, where they come from, and its free space.

Each rate, in this order: stated (``--ssd-read-gbps`` / ``--ssd-write-gbps``); recorded in a
hardware file (``tinypipe profile --offload-dir DIR`` measures them); measured now on the offload
directory (``measure=True``: ``tinypipe plan --offload-dir DIR``, 1 GiB written and read back,
:func:`tinypipe.storage.measure_rates`); the hardware preset's (a typical NVMe Gen4 drive unless the
preset says it was measured, :data:`~tinypipe.planner.hardware.TYPICAL_NVME_GEN4`). The engine
never measures: it takes the hardware's rates (they only rank plans there; the offload set itself
depends on the budget, not on the rates).

Several offload directories (one per drive, the state striped over them,
:mod:`tinypipe.storage.stripe`): the rates are the striped set's -- stated (``--ssd-read-gbps`` is
the aggregate), recorded by ``tinypipe profile --offload-dir A,B``, or measured on all of them at
once -- and the free space is what the set can hold with each directory holding its share.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, replace

from collections.abc import Sequence

from tinypipe.errors import ConfigError
from tinypipe.planner.hardware import HARDWARE, TYPICAL_NVME_GEN4, HardwareSpec

#: Bytes ``tinypipe plan --offload-dir`` writes and reads back to measure the directory.
MEASURE_BYTES = 1 << 30


def sharded_ssd_refusal() -> ConfigError:
    """The one refusal of the SSD tier under replicas that shard the optimizer state (planner and
    engine alike): the shards' SSD files and their I/O schedule are not built."""
    return ConfigError("the SSD tier is not combined with optimizer state sharded across replicas yet: "
                       "use Config(optimizer_sharding='replicate') or no offload_dir")


@dataclass(frozen=True)
class SsdSpec:
    """The offload directory the plan is for (``None``: rates only, no disk check); several: a
    :class:`~tinypipe.storage.stripe.DirectorySet` (prints as ``/a, /b``), the rates the set's."""

    read_gbps: float
    write_gbps: float
    directory: str | tuple[str, ...] | None = None
    free_bytes: int | None = None  # what the directories can hold (:func:`free_space`) when they exist
    source: str = ""  # where the rates come from, for the printed plan
    #: read + written GB/s with both in flight, when measured with the two rates (None: the time
    #: model takes the serial time, :class:`~tinypipe.planner.ssd_lanes.SsdLanes`)
    mixed_gbps: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def apply(self, hw: HardwareSpec) -> HardwareSpec:
        """``hw`` with these SSD rates (what the cost model reads)."""
        return replace(hw, ssd_read_gbps=self.read_gbps, ssd_write_gbps=self.write_gbps,
                       ssd_mixed_gbps=self.mixed_gbps)


def free_space(directory: str | Sequence[str] | None) -> int | None:
    """Free bytes on ``directory``'s filesystem, None when there is no such directory. Several
    directories: the most the striped set can hold -- each holds an equal share, and directories
    on one filesystem share its free space (about: a share may exceed the mean by a chunk)."""
    if directory is None:
        return None
    dirs = [directory] if isinstance(directory, str) else list(directory)
    if not all(os.path.isdir(d) for d in dirs):
        return None
    groups: dict[int, list[str]] = {}
    for d in dirs:
        groups.setdefault(os.stat(d).st_dev, []).append(d)
    return min(int(shutil.disk_usage(g[0]).free) * len(dirs) // len(g) for g in groups.values())


def directories_of(directory: str | os.PathLike | Sequence[str | os.PathLike] | None) -> str | tuple | None:
    """``directory`` as the plan keeps it: a path, a DirectorySet of several, or None."""
    if directory is None:
        return None
    from tinypipe.storage.stripe import DirectorySet, as_directories

    dirs = as_directories(directory)
    return dirs[0] if len(dirs) == 1 else DirectorySet(dirs)


def _rate(name: str, value: float | str | None) -> float | None:
    if value is None:
        return None
    try:
        rate = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number of GB/s, got {value!r}") from None
    if not rate > 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    return rate


def ssd_spec(hw: HardwareSpec, *, directory: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
             read_gbps: float | str | None = None, write_gbps: float | str | None = None,
             measure: bool = False) -> SsdSpec:
    """The SSD's rates and free space for planning (see the module documentation for the order);
    ``directory``: one path or several (one per drive)."""
    directory = directories_of(directory)
    several = isinstance(directory, tuple)
    read, write = _rate("--ssd-read-gbps", read_gbps), _rate("--ssd-write-gbps", write_gbps)
    mixed = None  # only with both rates from one measurement (a stated rate is not measured with it)
    sources = []
    if read is not None or write is not None:
        sources.append("stated")
    if read is None or write is None:
        preset = HARDWARE.get(hw.name) is hw
        if not preset and hw.ssd_read_gbps and hw.ssd_write_gbps:
            if read is None and write is None:
                mixed = hw.ssd_mixed_gbps
            read, write = read or hw.ssd_read_gbps, write or hw.ssd_write_gbps
            sources.append(f"hardware file {hw.name}")
        elif measure and directory is not None and free_space(directory) is not None:
            from tinypipe.storage import measure_rates

            got = measure_rates(directory, MEASURE_BYTES * (len(directory) if several else 1),
                                mixed=read is None and write is None)
            mixed = float(got["mixed_gbps"]) if "mixed_gbps" in got else None
            read, write = read or float(got["read_gbps"]), write or float(got["write_gbps"])
            sources.append(f"measured on {directory}" + (" (striped)" if several else "")
                           + ("" if got["direct"] else " (buffered I/O)"))
        elif hw.ssd_read_gbps and hw.ssd_write_gbps:
            read, write = read or hw.ssd_read_gbps, write or hw.ssd_write_gbps
            typical = (hw.ssd_read_gbps, hw.ssd_write_gbps) == TYPICAL_NVME_GEN4
            sources.append(f"preset {hw.name}" + (" (a typical NVMe Gen4 drive)" if typical else ""))
        else:
            read, write = read or TYPICAL_NVME_GEN4[0], write or TYPICAL_NVME_GEN4[1]
            sources.append("a typical NVMe Gen4 drive (not measured)")
    return SsdSpec(read_gbps=read, write_gbps=write, directory=directory, free_bytes=free_space(directory),
                   source=", ".join(sources), mixed_gbps=mixed)
