"""Examples tokenized into ``(input_ids, labels)`` pairs, each ending in EOS
(:func:`tokenize_examples`).

Labels stay aligned with ``input_ids`` (the model shifts them, like Hugging Face does);
:data:`IGNORE_INDEX` marks positions excluded from the loss: a prompt's tokens, and in chat
records everything outside the assistant turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tinypipe.train.records import DataError, Example, Format, log_skip, one_line

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
"""Label value the loss ignores (``torch.nn.CrossEntropyLoss`` default)."""


def _encode(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], special: bool) -> list[list[int]]:
    """Batch-encode with the tokenizer's normal special-token behaviour (e.g. BOS)."""
    if not texts:
        return []
    out = tokenizer(list(texts), add_special_tokens=special, verbose=False)["input_ids"]
    return [list(ids) for ids in out]


def eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
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
        raise DataError(f"chat template failed: {type(exc).__name__}: {one_line(str(exc))}") from None
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
    eos = eos_id(tokenizer)
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
            skipped = log_skip(Path(source), example.line, err, skipped)
    return out, skipped
