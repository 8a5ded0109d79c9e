"""The held-out set of a run: split from the training rows or loaded from its own file, evaluated
whole through :meth:`tinypipe.Engine.evaluate` (forward only), combined over its batches.

A split is seeded and fixed for the run (the same rows after ``--resume``); the training rows keep
their order, so the training batches still follow from the seed alone.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from tinypipe.errors import ConfigError
from tinypipe.runtime.inputs import document_starts

if TYPE_CHECKING:
    from tinypipe.runtime.engine import Engine
    from tinypipe.train.data import PackedDataset


def split_eval(dataset: PackedDataset, fraction: float, seed: int) -> tuple[PackedDataset, PackedDataset]:
    """(training rows, held-out rows): ``fraction`` of the rows (at least one), chosen by ``seed``;
    whole rows, with their position ids (packed documents) or padding masks."""
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"eval_split must be in (0, 1), got {fraction}")
    n = len(dataset)
    take = max(1, round(fraction * n))
    if take >= n:
        raise ConfigError(f"eval_split {fraction:g} of {n} rows leaves nothing to train on")
    digest = hashlib.sha256(f"tinypipe-eval-split:{int(seed)}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    held = torch.zeros(n, dtype=torch.bool)
    held[torch.randperm(n, generator=gen)[:take]] = True
    keep = (~held).nonzero().squeeze(1)
    out = held.nonzero().squeeze(1)
    return dataset.select(keep), dataset.select(out)


def eval_batches(dataset: PackedDataset, rows: int) -> Iterator[dict[str, torch.Tensor]]:
    """Every row of ``dataset`` in order, ``rows`` at a time (the last batch may be smaller), as
    the training batches are built: position ids of packed rows, padding masks of padded ones."""
    if rows < 1:
        raise ConfigError(f"eval batch must be >= 1 rows, got {rows}")
    for lo in range(0, len(dataset), rows):
        yield dataset.row_batch(slice(lo, lo + rows))


def _labelled(batch: dict[str, torch.Tensor]) -> bool:
    """Whether ``batch`` has a target the loss counts (a document's last token predicts no next
    document's first: :func:`tinypipe.runtime.inputs.prepare_inputs`)."""
    targets = batch["labels"][:, 1:] != -100
    pos = batch.get("position_ids")
    if pos is not None:
        targets &= ~document_starts(pos)[:, 1:]
    return bool(targets.any())


def evaluate_dataset(engine: Engine, dataset: PackedDataset, rows: int) -> dict[str, float | int]:
    """The held-out loss over all of ``dataset`` (token-weighted over its batches), its perplexity,
    the labelled tokens and the seconds it took -- the ``eval_*`` fields of a metrics record."""
    loss_sum, tokens, seconds = 0.0, 0, 0.0
    for batch in eval_batches(dataset, rows):
        if not _labelled(batch):
            continue  # nothing labelled in these rows (e.g. prompts only)
        r = engine.evaluate(batch)
        loss_sum += r.loss_sum
        tokens += r.tokens
        seconds += r.seconds
    if tokens == 0:
        raise ConfigError("the evaluation data has no labelled tokens")
    loss = loss_sum / tokens
    return {"eval_loss": loss, "eval_perplexity": math.exp(loss) if loss < 700 else float("inf"),
            "eval_tokens": tokens, "eval_seconds": seconds}
