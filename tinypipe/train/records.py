"""Training data files read and validated into examples (:func:`read_records`).

Supported inputs (format chosen per file):

* ``.jsonl`` / ``.json`` (JSON Lines), one record per line, detected from the
  first valid record's keys:

  - ``{"text": ...}``: plain language modelling, every token is trained on.
  - ``{"prompt": ..., "completion": ...}``: loss only on completion tokens.
  - ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered with the
    tokenizer's chat template, loss only on assistant turns.

* ``.txt``: the whole file is one document.

A bad line is a one-line :class:`DataError` naming the file and line, or (``skip_bad_lines``)
skipped and logged; a file mixing formats is always refused.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tinypipe.errors import TinypipeError

log = logging.getLogger(__name__)

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
        super().__init__(one_line(message, 500))


class _MixedFormats(DataError):
    """Raised for format mixing, which ``skip_bad_lines`` must not swallow."""


@dataclass(frozen=True)
class Example:
    """One validated record; ``line`` (1-based) lets later errors point back at the source."""

    line: int
    text: str = ""
    prompt: str = ""
    completion: str = ""
    messages: tuple[dict[str, str], ...] = ()


def one_line(text: str, limit: int = _MAX_SHOWN) -> str:
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


def detect_format(record: dict[str, Any]) -> Format:
    """Decide a record's format from its keys (extra keys such as ``id`` are ignored)."""
    if "messages" in record:
        return "chat"
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    keys = ", ".join(repr(k) for k in list(record)[:5]) or "none"
    raise DataError(f"no 'text', 'prompt'/'completion' or 'messages' field (keys: {one_line(keys)})")


def _parse_message(index: int, message: Any) -> dict[str, str]:
    """Validate one chat message; only role and content are kept for rendering."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise DataError(f"{where} must be an object, got {_type_name(message)}")
    if "role" not in message:
        raise DataError(f"{where} has no 'role'")
    role = message["role"]
    if not isinstance(role, str) or role not in ROLES:
        shown = one_line(repr(role)) if isinstance(role, str) else _type_name(role)
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
        raise DataError(f"invalid JSON ({one_line(str(exc)) or type(exc).__name__})") from None


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


def log_skip(path: Path, line: int, err: DataError, skipped: int, quiet: bool = False) -> int:
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
            skipped = log_skip(path, line_no, err, skipped, quiet)
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
