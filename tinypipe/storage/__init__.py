"""The SSD tier's I/O layer: training state that does not fit in DRAM, on an NVMe scratch file.

- :class:`SsdStateStore` -- named regions (``(layer, kind)`` -> bytes) of one preallocated
  scratch file per offload directory (several: striped, one per drive), read and written
  asynchronously with direct I/O by a few worker threads per directory.
- :class:`StagingPool` -- the bounded, page-aligned, pinnable host buffers the state is staged
  in around its optimizer step (the only host memory the tier adds).
- :class:`StateStager` -- one layer's read-ahead into staging slots and its write-back, with the
  slots returned to the pool only once the write landed.
- :class:`ScratchDir` -- the run's locked scratch directory; leftovers of killed runs are swept.
- :func:`measure_rates` / :func:`measure_directories` -- read/write GB/s of a directory or a
  striped set (and of each of its directories), for ``tinypipe profile``.

Layering: this package sits at the ``memory`` level (it imports torch, ``tinypipe.errors`` and
``tinypipe.devices.host_buffers`` only).
"""

from tinypipe.storage.io_stats import IoRecord, IoStats, IoTotals
from tinypipe.storage.rates import measure_directories, measure_rates
from tinypipe.storage.scratch import ScratchDir, check_directory, check_free_space, sweep_stale
from tinypipe.storage.stager import StagedLayer, StateStager
from tinypipe.storage.staging import StagingPool, StagingSlot
from tinypipe.storage.store import IoHandle, SsdStateStore

__all__ = [
    "IoHandle", "IoRecord", "IoStats", "IoTotals", "ScratchDir", "SsdStateStore", "StagedLayer",
    "StagingPool", "StagingSlot", "StateStager", "check_directory", "check_free_space",
    "measure_directories", "measure_rates", "sweep_stale",
]
