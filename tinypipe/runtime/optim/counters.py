"""Setting a layer's optimizer step count (``LayerState.step``), from the optimizer path or a
checkpoint being restored.

The count says how many AdamW steps a layer's moments hold: it picks the bias correction, and a
first step zeroes the moments. It changes only in :mod:`tinypipe.runtime.optim` -- the optimizer
path, its decisions (undo and redo), the sharded view -- and a checkpoint loader restores it through
:func:`set_layer_step`; ``tests/test_house.py`` holds the rest of the package to that.
"""

from __future__ import annotations

from tinypipe.memory.host_store import LayerState


def set_layer_step(state: LayerState, step: int) -> None:
    """Set ``state``'s step count: the optimizer stepped it, or a checkpoint restored its moments."""
    state.step = step
