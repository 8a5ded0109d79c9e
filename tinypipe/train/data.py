"""Training data for causal-LM fine-tuning: read, validate, tokenize, pack.

Supported inputs (format chosen per file):

* ``.jsonl`` / ``.json`` (JSON Lines), one record per line, detected from the
  first valid record's keys:

  - ``{"text": ...}``: plain language modelling, every token is trained on.
  - ``{"prompt": ..., "completion": ...}``: loss only on completion tokens.
  - ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered with the
    tokenizer's chat template, loss only on assistant turns.

* ``.txt``: the whole file is one document.

Examples are tokenized (each ending in EOS) and packed into rows of ``seq_len``
tokens without ever splitting an example that fits in a row: whole examples
share a row, each a separate document -- position ids restart at 0 and the
model attends only within the document (transformers builds block-diagonal
masks from such position ids; see :func:`pack`). Examples longer than
``seq_len`` are cut into rows and counted (``DataStats.split_examples``).
``packing=False`` pads every example to its own row instead. Labels stay
aligned with ``input_ids`` (the model shifts them, like Hugging Face does);
``-100`` marks positions excluded from the loss.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from tinypipe.errors import TinypipeError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "IGNORE_INDEX",
    "ROLES",
    "DataError",
    "DataStats",
    "Example",
    "PackedDataset",
    "detect_format",
    "load_dataset",
    "pack",
    "read_jsonl",
    "read_records",
    "read_text_file",
    "tokenize_examples",
]

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Label value the loss ignores (``torch.nn.CrossEntropyLoss`` default)."""

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
"""Chat roles accepted in ``messages`` records; anything else is likely a typo."""

Format = Literal["text", "prompt_completion", "chat", "txt"]
JSONL_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt",)
_MAX_SHOWN = 80
_MAX_LOGGED_SKIPS = 10


class DataError(TinypipeError, ValueError):
    """A problem with the user's training data; the message is one line, shown as-is."""

    def __init__(self, message: str) -> None:
        super().__init__(_one_line(message, 500))


class _MixedFormats(DataError):
    """Raised for format mixing, which ``skip_bad_lines`` must not swallow."""


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


@dataclass(frozen=True)
class Example:
    """One validated record; ``line`` (1-based) lets later errors point back at the source."""

    line: int
    text: str = ""
    prompt: str = ""
    completion: str = ""
    messages: tuple[dict[str, str], ...] = ()


# --------------------------------------------------------------------------- helpers


def _one_line(text: str, limit: int = _MAX_SHOWN) -> str:
    """Collapse whitespace and truncate, so that messages stay single-line and short."""
    flat = " ".join(str(text).split())
    flat = flat.encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates would break printing
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _type_name(value: Any) -> str:
    """JSON-ish type names read better in errors than Python ones (null, not NoneType)."""
    names = {type(None): "null", bool: "boolean", int: "number", float: "number",
             str: "string", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _check_unicode(value: str, what: str) -> None:
    """JSON allows lone surrogates (\\ud800) but tokenizers cannot encode them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(f"{what} contains invalid Unicode (a lone surrogate escape)") from None


def _nonempty_str(record: dict[str, Any], key: str) -> str:
    """Fetch a required string field that must contain some non-whitespace text."""
    if key not in record:
        raise DataError(f"missing {key!r} field")
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{key!r} must be a string, got {_type_name(value)}")
    if not value.strip():
        raise DataError(f"{key!r} is empty")
    _check_unicode(value, repr(key))
    return value


# --------------------------------------------------------------------------- reading


def detect_format(record: dict[str, Any]) -> Format:
    """Decide a record's format from its keys (extra keys such as ``id`` are ignored)."""
    if "messages" in record:
        return "chat"
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    keys = ", ".join(repr(k) for k in list(record)[:5]) or "none"
    raise DataError(f"no 'text', 'prompt'/'completion' or 'messages' field (keys: {_one_line(keys)})")


def _parse_message(index: int, message: Any) -> dict[str, str]:
    """Validate one chat message; only role and content are kept for rendering."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise DataError(f"{where} must be an object, got {_type_name(message)}")
    if "role" not in message:
        raise DataError(f"{where} has no 'role'")
    role = message["role"]
    if not isinstance(role, str) or role not in ROLES:
        shown = _one_line(repr(role)) if isinstance(role, str) else _type_name(role)
        raise DataError(f"{where} has unknown role {shown} (expected one of {', '.join(sorted(ROLES))})")
    if "content" not in message:
        raise DataError(f"{where} has no 'content'")
    content = message["content"]
    if not isinstance(content, str):
        raise DataError(f"{where} 'content' must be a string, got {_type_name(content)}")
    _check_unicode(content, f"{where} 'content'")
    return {"role": role, "content": content}


def _parse_example(record: dict[str, Any], fmt: Format, line: int) -> Example:
    """Validate a record of a known format and turn it into an ``Example``."""
    if fmt == "text":
        return Example(line, text=_nonempty_str(record, "text"))
    if fmt == "prompt_completion":
        prompt = _nonempty_str(record, "prompt")
        return Example(line, prompt=prompt, completion=_nonempty_str(record, "completion"))
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError("'messages' must be a non-empty array")
    parsed = tuple(_parse_message(i, m) for i, m in enumerate(messages))
    if not any(m["role"] == "assistant" for m in parsed):
        raise DataError("'messages' has no assistant message, so there is nothing to train on")
    return Example(line, messages=parsed)


def _decode_json_line(raw: bytes) -> Any:
    """Bytes of one line -> JSON value; every failure becomes a ``DataError``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError("invalid UTF-8") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"invalid JSON ({exc.msg})") from None
    except (ValueError, RecursionError) as exc:  # e.g. huge integers, absurd nesting
        raise DataError(f"invalid JSON ({_one_line(str(exc)) or type(exc).__name__})") from None


def _read_bytes(path: Path) -> bytes:
    """Read a whole file, turning OS errors into ``DataError`` naming the path."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, expected a file") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _skip(path: Path, line: int, err: DataError, skipped: int, quiet: bool = False) -> int:
    """Log (the first few) skipped lines so that skipping is never silent (``quiet``: a check that
    reads the file again later, which logs them then -- each line is reported once)."""
    if skipped < _MAX_LOGGED_SKIPS and not quiet:
        log.warning("skipping %s:%d: %s", path, line, err)
    return skipped + 1


def read_jsonl(path: str | os.PathLike[str], *,
               skip_bad_lines: bool = False, quiet: bool = False) -> tuple[Format, list[Example], int]:
    """Read a JSON Lines file into validated examples.

    Returns ``(format, examples, bad_lines_skipped)``. Blank lines are ignored.
    A bad line raises ``DataError("file:line: why")`` unless ``skip_bad_lines``;
    a record of a different format than the file's is always an error, since
    that means the file is not what the user thinks it is.
    """
    path = Path(path)
    data = _read_bytes(path)
    if data.startswith(b"\xef\xbb\xbf"):  # UTF-8 BOM written by some editors
        data = data[3:]
    fmt: Format | None = None
    fmt_line = 0
    examples: list[Example] = []
    skipped = 0
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            record = _decode_json_line(raw)
            if not isinstance(record, dict):
                raise DataError(f"expected a JSON object, got {_type_name(record)}")
            record_fmt = detect_format(record)
            if fmt is not None and record_fmt != fmt:
                raise _MixedFormats(
                    f"{path}:{line_no}: record is {record_fmt!r} but the file is {fmt!r} "
                    f"(from line {fmt_line}); one format per file"
                )
            example = _parse_example(record, record_fmt, line_no)
        except _MixedFormats:
            raise
        except DataError as err:
            if not skip_bad_lines:
                raise DataError(f"{path}:{line_no}: {err}") from None
            skipped = _skip(path, line_no, err, skipped, quiet)
            continue
        if fmt is None:
            fmt, fmt_line = record_fmt, line_no
        examples.append(example)
    if fmt is None:
        extra = f" ({skipped} bad lines skipped)" if skipped else ""
        raise DataError(f"{path}: no usable records{extra}")
    return fmt, examples, skipped


def read_text_file(path: str | os.PathLike[str]) -> str:
    """Read a ``.txt`` file as one document (UTF-8; a BOM is dropped)."""
    path = Path(path)
    data = _read_bytes(path)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{path}:{line}: invalid UTF-8") from None
    if not text.strip():
        raise DataError(f"{path}: file is empty")
    return text


def read_records(path: str | os.PathLike[str], *, skip_bad_lines: bool = False,
                 quiet: bool = False) -> tuple[Format, list[Example], int]:
    """Read any supported file, dispatching on its extension (``quiet``: skipped lines not logged)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return read_jsonl(path, skip_bad_lines=skip_bad_lines, quiet=quiet)
    if suffix in TEXT_SUFFIXES:
        return "txt", [Example(1, text=read_text_file(path))], 0
    if not path.exists():
        raise DataError(f"{path}: file not found")
    accepted = ", ".join(JSONL_SUFFIXES + TEXT_SUFFIXES)
    raise DataError(f"{path}: unsupported file type {suffix or '(no extension)'!r}; expected one of "
                    f"{accepted}")


# --------------------------------------------------------------------------- tokenizing


def _encode(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], special: bool) -> list[list[int]]:
    """Batch-encode with the tokenizer's normal special-token behaviour (e.g. BOS)."""
    if not texts:
        return []
    out = tokenizer(list(texts), add_special_tokens=special, verbose=False)["input_ids"]
    return [list(ids) for ids in out]


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """Documents are separated by EOS, so a tokenizer without one cannot be used."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no EOS token; set tokenizer.eos_token")
    return int(eos)


def _strip_eos(ids: list[int], eos: int) -> list[int]:
    """Drop an EOS the tokenizer appended itself, so that a prompt does not end the document."""
    return ids[:-1] if ids and ids[-1] == eos else ids


def _tokenize_text(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example],
                   eos: int) -> list[tuple[list[int], list[int]]]:
    """Plain text: every token, EOS included, is a training target."""
    out = []
    for ids in _encode(tokenizer, [e.text for e in examples], special=True):
        ids = _strip_eos(ids, eos) + [eos]
        out.append((ids, list(ids)))
    return out


def _tokenize_prompt_completion(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], eos: int
) -> list[tuple[list[int], list[int]]]:
    """Prompt and completion are tokenized apart so the mask boundary is exact."""
    prompts = _encode(tokenizer, [e.prompt for e in examples], special=True)
    completions = _encode(tokenizer, [e.completion for e in examples], special=False)
    out = []
    for p, c in zip(prompts, completions):
        p = _strip_eos(p, eos)
        c = c + [eos]  # the model must learn to stop after the completion
        out.append((p + c, [IGNORE_INDEX] * len(p) + c))
    return out


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]],
            generation_prompt: bool) -> str:
    """Render messages with the chat template; template failures become ``DataError``."""
    try:
        rendered = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as exc:  # user-supplied Jinja can raise anything
        raise DataError(f"chat template failed: {type(exc).__name__}: {_one_line(str(exc))}") from None
    if not isinstance(rendered, str):
        raise DataError(f"chat template returned {type(rendered).__name__}, expected a string")
    return rendered


def _find_content(full: str, content: str, cursor: int, index: int) -> tuple[int, int]:
    """Fallback: locate an assistant message's text verbatim in the rendering."""
    for needle in (content, content.strip()):
        pos = full.find(needle, cursor)
        if pos >= 0:
            return pos, pos + len(needle)
    raise DataError(f"chat template does not render messages[{index}] verbatim; cannot find the assistant "
                    "tokens")


def _assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]],
                     full: str) -> list[tuple[int, int]]:
    """Character spans of ``full`` that belong to assistant turns.

    The span of assistant message ``i`` runs from the end of the rendering of
    ``messages[:i]`` plus the generation prompt to the end of the rendering of
    ``messages[:i+1]``, so it covers the content and the template's
    end-of-turn marker (the model must learn to stop). Where a template does
    not render prefixes consistently (or the turn is first), that boundary
    falls back to where the content appears verbatim.
    """
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        content = message["content"]
        start_text = _render(tokenizer, messages[:i], generation_prompt=True) if i else ""
        end_text = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if i and cursor <= len(start_text) and full.startswith(start_text):
            start = len(start_text)
        elif content.strip():
            start = _find_content(full, content, cursor, i)[0]
        else:  # an empty reply with no usable prefix: nothing to locate or learn
            continue
        if full.startswith(end_text) and len(end_text) >= start:
            end = len(end_text)
        elif content.strip():
            end = _find_content(full, content, start, i)[1]
        else:
            end = start
        spans.append((start, end))
        cursor = end
    return spans


def _tokenize_chat(tokenizer: PreTrainedTokenizerBase, example: Example,
                   eos: int) -> tuple[list[int], list[int]]:
    """Render with the chat template; label only tokens inside assistant spans.

    Segments are tokenized separately (without extra special tokens, as
    ``apply_chat_template`` does: templates insert BOS themselves) so every
    token belongs wholly to one side of the mask.
    """
    messages = example.messages
    full = _render(tokenizer, messages, generation_prompt=False)
    ids: list[int] = []
    labels: list[int] = []
    cursor = 0
    for start, end in _assistant_spans(tokenizer, messages, full) + [(len(full), len(full))]:
        for text, trained in ((full[cursor:start], False), (full[start:end], True)):
            if text:
                seg = _encode(tokenizer, [text], special=False)[0]
                ids += seg
                labels += seg if trained else [IGNORE_INDEX] * len(seg)
        cursor = end
    if not ids or ids[-1] != eos:
        ids.append(eos)
        labels.append(eos if messages[-1]["role"] == "assistant" else IGNORE_INDEX)
    return ids, labels


def tokenize_examples(
    examples: Sequence[Example],
    fmt: Format,
    tokenizer: PreTrainedTokenizerBase,
    *,
    source: str = "<data>",
    skip_bad_lines: bool = False,
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """Tokenize examples into ``(input_ids, labels)`` pairs, each ending in EOS.

    Returns the pairs and how many chat records were skipped because the
    template failed on them (only with ``skip_bad_lines``; otherwise
    ``DataError("source:line: ...")``).
    """
    eos = _eos_id(tokenizer)
    if fmt in ("text", "txt"):
        return _tokenize_text(tokenizer, examples, eos), 0
    if fmt == "prompt_completion":
        return _tokenize_prompt_completion(tokenizer, examples, eos), 0
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{source}: chat-format data needs a tokenizer with a chat template, and this one "
                        "has none")
    out, skipped = [], 0
    for example in examples:
        try:
            out.append(_tokenize_chat(tokenizer, example, eos))
        except DataError as err:
            if not skip_bad_lines:
                raise DataError(f"{source}:{example.line}: {err}") from None
            skipped = _skip(Path(source), example.line, err, skipped)
    return out, skipped


# --------------------------------------------------------------------------- packing


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


# --------------------------------------------------------------------------- entry point


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
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _eos_id(tokenizer)
    try:
        dataset, stats = pack(pairs, seq_len, packing=packing, pad_id=int(pad))
    except DataError as err:
        raise DataError(f"{path}: {err}") from None
    return dataset, dataclasses.replace(stats, bad_lines_skipped=bad + bad_tokenized, format=fmt)
