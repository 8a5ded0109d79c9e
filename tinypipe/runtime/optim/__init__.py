"""The optimizer path: everything between a layer's downloaded gradient and its updated weights.

- :mod:`~tinypipe.runtime.optim.path`: :class:`OptimizerPath`, the one owner the engine and the
  update tasks call (begin_step, consume, finish_step, wait_layer, synchronize), the route of each
  layer's downloaded gradient, and the step counts.
- :mod:`~tinypipe.runtime.optim.counters`: setting a layer's step count (a checkpoint restores it here).
- :mod:`~tinypipe.runtime.optim.messages`: what a download task sends its update task.
- :mod:`~tinypipe.runtime.optim.decisions`: speculate / defer / skip, exact clipping and rollback.
- :mod:`~tinypipe.runtime.optim.background`: a clipped step's leftover work, overlapping the next step.
- :mod:`~tinypipe.runtime.optim.device_state`: AdamW state of layers stepped on their device.
- :mod:`~tinypipe.runtime.optim.adamw`: the chunked fused AdamW math (and its inverse) they all use.
"""
