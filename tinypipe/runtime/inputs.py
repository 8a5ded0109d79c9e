"""The step's inputs: a user's batch validated and turned into what the task handlers read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from tinypipe.errors import BatchError


@dataclass
class StepInputs:
    """The global batch, already validated, on the host."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    shifted_labels: torch.Tensor  # labels[:, 1:] padded with -100: position t predicts this
    denom: int  # labelled tokens in the whole global batch

    @property
    def batch(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq(self) -> int:
        return int(self.input_ids.shape[1])


def prepare_inputs(batch: Mapping[str, torch.Tensor], vocab: int, max_positions: int | None,
                   pin: bool) -> StepInputs:
    """Validate a global batch (one-line :class:`BatchError` for anything malformed) and build the
    step's host-side inputs: labels shifted by one, padding ignored, the labelled-token count.
    ``pin``: page-lock them so device copies never synchronise a stream."""
    if not isinstance(batch, Mapping):
        raise BatchError("batch must be a dict with 'input_ids' (and optional 'labels', 'attention_mask'), "
                         f"got {type(batch).__name__}")
    if "input_ids" not in batch:
        raise BatchError("batch needs 'input_ids' (LongTensor[batch, seq])")
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise BatchError("input_ids must be an integer tensor of shape [batch, seq]")
    ids = ids.long().cpu()
    B, S = ids.shape
    if B == 0 or S < 2:
        raise BatchError(f"batch of shape {tuple(ids.shape)} is too small: need >= 1 sequence of >= 2 "
                         "tokens")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise BatchError(f"input_ids hold token ids outside the model's vocabulary [0, {vocab}) "
                         f"(min {int(ids.min())}, max {int(ids.max())}): was the data tokenized with this "
                         "model's tokenizer?")
    if max_positions is not None and S > max_positions:
        raise BatchError(f"sequence length {S} exceeds the model's max_position_embeddings {max_positions}")
    mask = batch.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (B, S):
            raise BatchError(f"attention_mask must have shape {(B, S)}")
        if mask.dtype.is_floating_point or mask.is_complex():
            raise BatchError("attention_mask must hold integers or booleans (1 = token, 0 = padding)")
        mask = mask.long().cpu()
        if bool(((mask != 0) & (mask != 1)).any()):
            raise BatchError("attention_mask must hold only 0 (padding) and 1 (token)")
    labels = batch.get("labels")
    if labels is None:
        labels = ids.clone()
        if mask is not None:
            labels[mask == 0] = -100
    else:
        if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != (B, S):
            raise BatchError(f"labels must have shape {(B, S)}")
        if labels.dtype.is_floating_point or labels.is_complex() or labels.dtype == torch.bool:
            raise BatchError("labels must be integer token ids (-100 = ignored)")
        labels = labels.long().cpu()
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    denom = int((shifted != -100).sum())
    if denom == 0:
        raise BatchError("batch has no labelled tokens (all labels are -100)")
    bad = (shifted != -100) & ((shifted < 0) | (shifted >= vocab))
    if bool(bad.any()):
        raise BatchError(f"labels hold ids outside the vocabulary [0, {vocab}) (use -100 to ignore)")
    if pin:  # pinned: device copies never sync a stream
        ids, shifted = ids.pin_memory(), shifted.pin_memory()
        mask = mask.pin_memory() if mask is not None else None
    return StepInputs(ids, mask, shifted, denom)
