"""Dequantize a GGUF file one tensor at a time, with transformers' own name mapping and fix-ups.

``from_pretrained(gguf_file=...)`` dequantizes every tensor into one fp32 state dict and then
loads it into a model: the model's weights twice over. Here the same pieces transformers uses
(gguf's ``GGUFReader``/``dequantize``, transformers' per-architecture ``TensorProcessor`` that
undoes llama.cpp's q/k permutation and reshapes, and its GGUF->HF name map) run per tensor, and
each result is handed to the caller, who copies it into place before the next one is made.

Peak extra memory over the final fp32 store: ``GGUFReader``'s parsed metadata (numpy arrays per
field; ~150 MB for SmolLM2's 49 K-token vocabulary), the memory-mapped quantized file (its pages
count in RSS once read: ~90 MB for SmolLM2-135M Q4_1) and one dequantized tensor (the largest is
usually the embedding, 113 MB for SmolLM2). So the bound "store + one layer" holds for the tensors
but not for the GGUF container's overheads; measured for SmolLM2-135M (store 538 MB): see
``bench/load_peak.py FILE.gguf``. Processors that assemble one HF tensor
from several GGUF tensors (MoE experts) keep their partial results until the end, as in
transformers. These are transformers internals (``transformers.modeling_gguf_pytorch_utils``);
:func:`iter_gguf_tensors` raises ``ImportError`` when they are not there, and the caller falls
back to the whole-state-dict load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import nn

__all__ = ["iter_gguf_tensors"]


def iter_gguf_tensors(file: Path, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_key, fp32 tensor)`` for every tensor of ``file`` that maps onto ``model``."""
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    reader = GGUFReader(str(file))
    architecture = read_field(reader, "general.architecture")[0]
    # the processors read HF-named config values (num_attention_heads, ...): the model's config
    # holds exactly those, without re-parsing the file's metadata (tokenizer included) again
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    mapping = get_gguf_hf_weights_map(model, processor)
    side: dict[str, dict] = {"tensors": {}}  # where multi-tensor processors assemble their results
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=mapping,
                                   parsed_parameters=side)
        del weights
        name = result.name
        if name not in mapping:
            continue
        array = result.weights
        if not (isinstance(array, np.ndarray) and array.flags.writeable):
            array = np.array(array)  # a read-only view of the mapped file: one copy of this tensor
        yield mapping[name], torch.from_numpy(array)
        del array, result
    for key in list(side["tensors"]):
        yield key, side["tensors"].pop(key)
