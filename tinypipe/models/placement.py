"""Parameters placed in one flat fp32 buffer per layer, at the decomposition's offsets.

Both sides of a copy-free load use this layout: the skeleton loader
(:class:`~tinypipe.models.skeleton.LayerMaterialiser`) allocates the buffers and points the model's
parameters at views of them, and the engine's :class:`~tinypipe.memory.host_store.HostStore`
adopts such buffers instead of copying the weights. Kept here, below both, so that the model layer
never imports the memory layer.
"""

from __future__ import annotations

import torch

from tinypipe.models.decompose import LayerSpec

#: Attribute a loader sets on a model whose parameters it placed in this layout.
IN_PLACE_MARK = "_tinypipe_masters_in_place"


def zero_gaps(spec: LayerSpec, master: torch.Tensor) -> None:
    """Zero the alignment gaps between (and after) a layer's parameters in its flat buffer."""
    with torch.no_grad():
        end = 0
        for p in spec.params:
            master[end : p.offset].zero_()
            end = p.offset + p.numel
        master[end:].zero_()
