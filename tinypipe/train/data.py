"""Training data for causal-LM fine-tuning: read, validate, tokenize, pack (:func:`load_dataset`).

Files are read and validated by :mod:`tinypipe.train.records`, tokenized by
:mod:`tinypipe.train.tokenizing`, and packed here: examples (each ending in EOS) go into rows of
``seq_len`` tokens without ever splitting an example that fits in a row: whole examples share a
row, each a separate document -- position ids restart at 0 and the model attends only within the
document (transformers builds block-diagonal masks from such position ids; see :func:`pack`).
Examples longer than ``seq_len`` are cut into rows and counted (``DataStats.split_examples``).
``packing=False`` pads every example to its own row instead.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tinypipe.train.records import DataError, Format, read_records
from tinypipe.train.tokenizing import IGNORE_INDEX, eos_id, tokenize_examples

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class DataStats:
    """What ``load_dataset`` read and packed, for logging and sanity checks.

    ``tokens`` counts the examples' tokens (all kept: ``dropped_tokens`` is 0 since packing
    keeps whole examples); ``padding_tokens`` fill the rows' tails; ``split_examples`` were
    longer than a row and cut across rows; ``packing``: documents share rows (else one per row).
    """

    records: int
    bad_lines_skipped: int
    tokens: int
    rows: int
    dropped_tokens: int
    format: Format
    padding_tokens: int = 0
    split_examples: int = 0
    packing: bool = True

    def describe(self) -> str:
        """One line for the user: rows, padding, split examples."""
        pad = 100.0 * self.padding_tokens / max(1, self.tokens + self.padding_tokens)
        how = "packed, documents attend only within themselves" if self.packing else "one example per row"
        split = (f"; {self.split_examples} example(s) longer than a row split across rows"
                 if self.split_examples else "")
        return f"{self.rows} rows ({how}; {pad:.1f}% padding){split}"


class PackedDataset:
    """Fixed-length rows of tokens with aligned labels, plus a resumable batch order.

    ``position_ids`` (packed rows): each document's positions start at 0, which is how the
    engine and transformers tell documents apart. ``attention_mask`` (padded rows): 0 on
    padding. With neither, every row is one sequence.
    """

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor,
                 position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> None:
        if input_ids.dim() != 2 or input_ids.shape != labels.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must be "
                             "equal 2-D shapes")
        for name, t in (("position_ids", position_ids), ("attention_mask", attention_mask)):
            if t is not None and t.shape != input_ids.shape:
                raise ValueError(f"{name} {tuple(t.shape)} must have input_ids' shape "
                                 f"{tuple(input_ids.shape)}")
        self.input_ids = input_ids.to(torch.int64)
        self.labels = labels.to(torch.int64)
        self.position_ids = position_ids.to(torch.int64) if position_ids is not None else None
        self.attention_mask = attention_mask.to(torch.int64) if attention_mask is not None else None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def document_tokens(self) -> int:
        """The rows' documents' token-weighted mean length (sum of squared lengths / sum of
        lengths; ``seq_len`` for one document per row): what attention's FLOPs scale with, for the
        planner (``Config.document_tokens``)."""
        if self.position_ids is None:
            return self.seq_len
        starts = (self.position_ids == 0).flatten().nonzero().flatten()
        ends = torch.cat([starts[1:], starts.new_tensor([self.position_ids.numel()])])
        rows = self.seq_len
        # a document never crosses a row: each row starts one, so a span's end is clipped to its row
        ends = torch.minimum(ends, (starts // rows + 1) * rows)
        lengths = (ends - starts).double()
        return max(1, round(float((lengths * lengths).sum() / lengths.sum())))

    def select(self, index: slice | torch.Tensor) -> "PackedDataset":
        """The rows at ``index`` (e.g. a held-out split), with their positions or masks."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return PackedDataset(self.input_ids[index], self.labels[index], pick(self.position_ids),
                             pick(self.attention_mask))

    def row_batch(self, index: slice | torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows at ``index`` as an ``Engine.step`` batch."""
        out = {"input_ids": self.input_ids[index], "labels": self.labels[index]}
        if self.position_ids is not None:
            out["position_ids"] = self.position_ids[index]
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask[index]
        if self.position_ids is None and self.attention_mask is None:
            out["attention_mask"] = torch.ones_like(out["input_ids"])
        return out

    def num_batches(self, global_batch: int) -> int:
        """Full batches per epoch; the incomplete last one is dropped to keep shapes fixed."""
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        return len(self) // global_batch

    def batches(self, global_batch: int, seed: int, epoch: int,
                start_batch: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Yield shuffled batches; the order depends only on (seed, epoch).

        ``start_batch`` skips ahead without changing the order, so a resumed
        run sees exactly the batches the interrupted run had not yet seen.
        """
        total = self.num_batches(global_batch)
        if total == 0:
            raise DataError(f"the dataset has {len(self)} rows, fewer than one batch of {global_batch}")
        if not 0 <= start_batch <= total:
            raise ValueError(f"start_batch must be in [0, {total}], got {start_batch}")
        order = torch.randperm(len(self), generator=_generator(seed, epoch))
        for b in range(start_batch, total):
            yield self.row_batch(order[b * global_batch : (b + 1) * global_batch])


def _generator(seed: int, epoch: int) -> torch.Generator:
    """Hash (seed, epoch) so that nearby pairs do not collide (seed+epoch would)."""
    digest = hashlib.sha256(f"tinypipe-data:{int(seed)}:{int(epoch)}".encode()).digest()
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return generator


def _documents(pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
               seq_len: int) -> tuple[list[tuple[list[int], list[int]]], int]:
    """Examples as documents of at most ``seq_len`` tokens: one that fits stays whole; a longer one
    becomes full rows plus a remainder (counted in the second value)."""
    docs, split = [], 0
    for ids, labels in pairs:
        ids, labels = list(ids), list(labels)
        if len(ids) > seq_len:
            split += 1
        for lo in range(0, len(ids), seq_len):
            docs.append((ids[lo : lo + seq_len], labels[lo : lo + seq_len]))
    return docs, split


def _best_fit(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Rows of document indices, longest documents first, each into the fullest row it fits
    (best-fit decreasing: close to the fewest rows, so the least padding)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, row), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            space, row = free.pop(at)
        else:
            space, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(i)
        if space - n > 0:
            bisect.insort(free, (space - n, row))
    return rows


def pack(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int, *, packing: bool = True,
         pad_id: int = 0) -> tuple[PackedDataset, DataStats]:
    """Arrange examples into rows of ``seq_len`` tokens; no token is dropped.

    Packing (default): whole examples share rows (an example is split only when longer than a
    row). Each is its own document: positions restart at 0, its first token is not a target of
    the previous document (label -100), and the row's tail is padding (a document of its own,
    labels -100). ``packing=False``: one example per row, padded, with an attention mask.
    The stats' ``records``/``bad_lines_skipped``/``format`` are left for the caller to fill.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    docs, split = _documents(pairs, seq_len)
    if not docs:
        raise DataError("not enough data: no tokens")
    groups = _best_fit([len(d[0]) for d in docs], seq_len) if packing else [[i] for i in range(len(docs))]
    shape = (len(groups), seq_len)
    ids = torch.full(shape, pad_id, dtype=torch.int64)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.int64)
    positions = torch.zeros(shape, dtype=torch.int64)
    mask = torch.zeros(shape, dtype=torch.int64)
    for r, group in enumerate(groups):
        at = 0
        for i in group:
            d_ids, d_labels = docs[i]
            n = len(d_ids)
            ids[r, at : at + n] = torch.tensor(d_ids)
            labels[r, at : at + n] = torch.tensor(d_labels)
            if packing and at > 0:
                labels[r, at] = IGNORE_INDEX  # predicted from the previous document: no target
            positions[r, at : at + n] = torch.arange(n)
            at += n
        mask[r, :at] = 1
        positions[r, at:] = torch.arange(seq_len - at)
    tokens = sum(len(d[0]) for d in docs)
    dataset = PackedDataset(ids, labels, position_ids=positions) if packing else \
        PackedDataset(ids, labels, attention_mask=mask)
    stats = DataStats(records=len(pairs), bad_lines_skipped=0, tokens=tokens, rows=len(groups),
                      dropped_tokens=0, format="text", padding_tokens=len(groups) * seq_len - tokens,
                      split_examples=split, packing=packing)
    return dataset, stats


def load_dataset(
    path: str | os.PathLike[str],
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    *,
    skip_bad_lines: bool = False,
    packing: bool = True,
) -> tuple[PackedDataset, DataStats]:
    """Read, validate, tokenize and pack one data file for training (see :func:`pack`)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    fmt, examples, bad = read_records(path, skip_bad_lines=skip_bad_lines)
    pairs, bad_tokenized = tokenize_examples(examples, fmt, tokenizer, source=str(path),
                                             skip_bad_lines=skip_bad_lines)
    if not pairs:
        raise DataError(f"{path}: no usable records ({bad + bad_tokenized} bad lines skipped)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id(tokenizer)
    try:
        dataset, stats = pack(pairs, seq_len, packing=packing, pad_id=int(pad))
    except DataError as err:
        raise DataError(f"{path}: {err}") from None
    return dataset, dataclasses.replace(stats, bad_lines_skipped=bad + bad_tokenized, format=fmt)
