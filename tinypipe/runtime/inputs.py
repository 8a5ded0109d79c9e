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
    position_ids: torch.Tensor | None = None  # restarting inside a row: packed documents

    @property
    def batch(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq(self) -> int:
        return int(self.input_ids.shape[1])


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: where a new document starts inside a row -- the position id does not follow
    the previous one by 1 (the rule transformers' ``find_packed_sequence_indices`` applies)."""
    starts = torch.zeros_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    return starts


def _positions(batch: Mapping[str, torch.Tensor], shape: tuple[int, int],
               max_positions: int | None) -> torch.Tensor | None:
    pos = batch.get("position_ids")
    if pos is None:
        return None
    integer = isinstance(pos, torch.Tensor) and pos.dtype in (torch.int64, torch.int32)
    if not integer or tuple(pos.shape) != shape:
        raise BatchError(f"position_ids must be an integer tensor of shape {shape}")
    pos = pos.long().cpu()
    if int(pos.min()) < 0 or (max_positions is not None and int(pos.max()) >= max_positions):
        raise BatchError(f"position_ids must lie in [0, {max_positions}) (min {int(pos.min())}, "
                         f"max {int(pos.max())})")
    return pos


def _check_packed(pos: torch.Tensor | None, mask: torch.Tensor | None,
                  document_masks: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Packed rows (position ids restarting inside a row) must get per-document attention: refuse
    what would let documents attend to each other. Returns (mask, the document starts or None)."""
    if pos is None:
        return mask, None
    if mask is not None and bool((mask == 1).all()):
        mask = None  # transformers detects packed rows only without a padding mask
    starts = document_starts(pos)
    if not bool(starts.any()):
        return mask, None
    if mask is not None:
        raise BatchError("position_ids restart inside a row (packed documents) while attention_mask marks "
                         "padding: transformers then ignores the packing and documents attend to each "
                         "other; give padding its own position ids and labels -100, without a mask")
    if not document_masks:
        raise BatchError("position_ids restart inside a row (packed documents), but this model's "
                         "transformers code does not build per-document attention masks from position ids; "
                         "pad each document instead (tinypipe finetune --packing off)")
    return mask, starts


def prepare_inputs(batch: Mapping[str, torch.Tensor], vocab: int, max_positions: int | None,
                   pin: bool, document_masks: bool = True) -> StepInputs:
    """Validate a global batch (one-line :class:`BatchError` for anything malformed) and build the
    step's host-side inputs: labels shifted by one, padding ignored, the labelled-token count.
    ``position_ids`` that restart inside a row pack several documents into it: each attends only
    within itself (``document_masks``: the model's transformers code builds such masks, see
    :meth:`~tinypipe.models.decompose.Decomposition`), and no token is trained to predict the
    first token of the next document. ``pin``: page-lock them so device copies never synchronise
    a stream."""
    if not isinstance(batch, Mapping):
        raise BatchError("batch must be a dict with 'input_ids' (and optional 'labels', 'attention_mask', "
                         f"'position_ids'), got {type(batch).__name__}")
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
    pos = _positions(batch, (B, S), max_positions)
    mask, starts = _check_packed(pos, mask, document_masks)
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
    if starts is not None:  # the last token of a document does not predict the next document
        shifted[:, :-1][starts[:, 1:]] = -100
    denom = int((shifted != -100).sum())
    if denom == 0:
        raise BatchError("batch has no labelled tokens (all labels are -100)")
    bad = (shifted != -100) & ((shifted < 0) | (shifted >= vocab))
    if bool(bad.any()):
        raise BatchError(f"labels hold ids outside the vocabulary [0, {vocab}) (use -100 to ignore)")
    if pin:  # pinned: device copies never sync a stream
        ids, shifted = ids.pin_memory(), shifted.pin_memory()
        mask = mask.pin_memory() if mask is not None else None
        pos = pos.pin_memory() if pos is not None else None
    return StepInputs(ids, mask, shifted, denom, pos)
