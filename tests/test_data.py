"""Tests for tinypipe.train.data: readers, label masking, packing, batching, errors."""

from __future__ import annotations

import json
import os
import re
import string
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinypipe.errors import TinypipeError
from tinypipe.train.data import DataStats, PackedDataset, load_dataset, pack
from tinypipe.train.records import DataError, read_jsonl, read_records
from tinypipe.train.tokenizing import IGNORE_INDEX

try:
    from tests._data_helpers import LAST_TURN_TEMPLATE, STRICT_TEMPLATE, make_tokenizer, write_jsonl
except ImportError:  # pytest run with tests/ (not the repo root) on sys.path
    from _data_helpers import LAST_TURN_TEMPLATE, STRICT_TEMPLATE, make_tokenizer, write_jsonl

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def enc(tok, text: str, special: bool = False) -> list[int]:
    return tok(text, add_special_tokens=special)["input_ids"]


def flat(ds: PackedDataset) -> tuple[list[int], list[int]]:
    return ds.input_ids.flatten().tolist(), ds.labels.flatten().tolist()


def load_all(path: Path, tok, **kw):
    """Load with seq_len=1 so no token is dropped: rows flatten to the whole stream."""
    return load_dataset(path, tok, 1, **kw)


# --------------------------------------------------------------------------- formats and labels


def test_text_labels_equal_inputs_and_eos_between_docs(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "Hello world"}, {"text": "the lazy dog", "id": 7}])
    ds, stats = load_all(path, tok)
    ids, labels = flat(ds)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert ids == [bos, *enc(tok, "Hello world"), eos, bos, *enc(tok, "the lazy dog"), eos]
    assert labels == ids  # aligned, not pre-shifted: the model shifts internally
    # seq_len=1: both examples are longer than a row, so they are split (and counted)
    assert stats == DataStats(records=2, bad_lines_skipped=0, tokens=len(ids), rows=len(ids),
                              dropped_tokens=0, format="text", padding_tokens=0, split_examples=2,
                              packing=True)
    assert ds.input_ids.dtype == ds.labels.dtype == torch.int64


def test_tokenizer_without_bos_gets_none(tmp_path):
    tok = make_tokenizer(add_bos=False)
    ds, _ = load_all(write_jsonl(tmp_path / "d.jsonl", [{"text": "Hello world"}]), tok)
    assert flat(ds)[0] == [*enc(tok, "Hello world"), tok.eos_token_id]


def test_prompt_completion_masks_prompt(tmp_path, tok):
    path = write_jsonl(tmp_path / "pc.jsonl", [
        {"prompt": "Capital of France?", "completion": " Paris."},
        {"prompt": "Say hi", "completion": " Hello world"},
    ])
    ds, stats = load_all(path, tok)
    ids, labels = flat(ds)
    expected_ids, expected_labels = [], []
    for prompt, completion in [("Capital of France?", " Paris."), ("Say hi", " Hello world")]:
        p = [tok.bos_token_id, *enc(tok, prompt)]
        c = [*enc(tok, completion), tok.eos_token_id]
        expected_ids += p + c
        expected_labels += [IGNORE_INDEX] * len(p) + c
    assert ids == expected_ids
    assert labels == expected_labels
    trained = [t for t in labels if t != IGNORE_INDEX]
    assert tok.decode(trained, skip_special_tokens=True) == " Paris. Hello world"
    assert stats.format == "prompt_completion"


def _assistant_text(tok, labels: list[int]) -> str:
    return tok.decode([t for t in labels if t != IGNORE_INDEX], skip_special_tokens=True)


def test_chat_trains_only_on_assistant_turns(tmp_path, tok):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And Germany?"},
        {"role": "assistant", "content": "Berlin."},
    ]
    ds, stats = load_all(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}]), tok)
    ids, labels = flat(ds)
    full = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(ids) == full + tok.eos_token
    assert _assistant_text(tok, labels) == "Paris.Berlin."
    # The end-of-turn marker after each answer is trained (the model learns to stop),
    # the role headers and user/system text are not.
    end_id = tok.convert_tokens_to_ids("<|end|>")
    trained_ends = [i for i, (t, l) in enumerate(zip(ids, labels)) if t == end_id and l != IGNORE_INDEX]
    assert len(trained_ends) == 2
    for i, (t, l) in enumerate(zip(ids, labels)):
        assert l in (t, IGNORE_INDEX)
    assert labels[-1] == tok.eos_token_id
    assert stats.format == "chat" and stats.records == 1


def test_chat_per_turn_spans_decode_to_assistant_text(tmp_path, tok):
    answers = ["Hello world, how are you?", "I am fine, thank you.", "The quick brown fox."]
    messages = []
    for i, answer in enumerate(answers):
        messages += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": answer}]
    ds, _ = load_all(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}]), tok)
    ids, labels = flat(ds)
    spans, current = [], []
    for t, l in zip(ids, labels):
        if l != IGNORE_INDEX:
            current.append(l)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    # Final span also holds the EOS appended after the last assistant turn.
    assert [tok.decode(s, skip_special_tokens=True) for s in spans] == answers


def test_chat_ending_with_user_turn_does_not_train_trailing_eos(tmp_path, tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "bye"}]
    ds, _ = load_all(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}]), tok)
    ids, labels = flat(ds)
    assert ids[-1] == tok.eos_token_id and labels[-1] == IGNORE_INDEX
    assert _assistant_text(tok, labels) == "Hello"


def test_chat_fallback_for_inconsistent_template(tmp_path):
    tok = make_tokenizer(chat_template=LAST_TURN_TEMPLATE)
    messages = [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello world"},
        {"role": "user", "content": "more"}, {"role": "assistant", "content": "The lazy dog"},
    ]
    ds, _ = load_all(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}]), tok)
    ids, labels = flat(ds)
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
    assert _assistant_text(tok, labels) == "Hello worldThe lazy dog"


def test_chat_starting_with_assistant(tmp_path, tok):
    messages = [{"role": "assistant", "content": "Hello world"}, {"role": "user", "content": "hi"}]
    ds, _ = load_all(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}]), tok)
    ids, labels = flat(ds)
    assert _assistant_text(tok, labels) == "Hello world"
    end_id = tok.convert_tokens_to_ids("<|end|>")
    assert [l for t, l in zip(ids, labels) if t == end_id] == [end_id, IGNORE_INDEX]


def test_chat_needs_template(tmp_path):
    tok = make_tokenizer(chat_template=None)
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "assistant", "content": "x"}]}])
    with pytest.raises(DataError, match="chat template"):
        load_dataset(path, tok, 1)


def test_chat_template_error_names_line_and_can_be_skipped(tmp_path):
    tok = make_tokenizer(chat_template=STRICT_TEMPLATE)
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]}
    bad = {"messages": [{"role": "assistant", "content": "Hello"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [good, bad, good])
    with pytest.raises(DataError, match=r"c\.jsonl:2: chat template failed.*first message must be from the user"):
        load_dataset(path, tok, 1)
    _, stats = load_dataset(path, tok, 1, skip_bad_lines=True)
    assert (stats.records, stats.bad_lines_skipped) == (2, 1)


def test_txt_file_is_one_document(tmp_path, tok):
    text = "Hello world.\n\nThe quick brown fox.\n"
    path = tmp_path / "book.txt"
    path.write_text(text, encoding="utf-8")
    ds, stats = load_all(path, tok)
    ids, labels = flat(ds)
    assert ids == [tok.bos_token_id, *enc(tok, text), tok.eos_token_id] == labels
    assert stats.format == "txt" and stats.records == 1


def test_json_extension_read_as_jsonl_and_blank_lines_and_bom_ignored(tmp_path, tok):
    path = tmp_path / "d.JSON"
    path.write_bytes(b'\xef\xbb\xbf{"text": "Hello"}\n\n   \n{"text": "world"}\r\n')
    fmt, examples, skipped = read_records(path)
    assert fmt == "text" and [e.text for e in examples] == ["Hello", "world"] and skipped == 0
    assert [e.line for e in examples] == [1, 4]


# --------------------------------------------------------------------------- packing


def test_packing_keeps_examples_whole_and_drops_nothing(tmp_path, tok):
    texts = ["Hello world", "The quick brown fox jumps", "Paris is the capital", "Berlin"]
    records = [{"text": t} for t in texts]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    docs = [[tok.bos_token_id, *enc(tok, r["text"]), tok.eos_token_id] for r in records]
    seq_len = max(len(d) for d in docs) + 1
    ds, stats = load_dataset(path, tok, seq_len)
    assert ds.input_ids.shape == ds.labels.shape == ds.position_ids.shape == (stats.rows, ds.seq_len)
    assert stats.tokens == sum(len(d) for d in docs)
    assert stats.dropped_tokens == 0 and stats.split_examples == 0
    assert stats.padding_tokens == stats.rows * seq_len - stats.tokens
    rows = [r.tolist() for r in ds.input_ids]
    for d in docs:  # every example whole, inside one row, its positions 0..n-1
        where = [(r, i) for r, row in enumerate(rows) for i in range(seq_len - len(d) + 1)
                 if row[i : i + len(d)] == d]
        assert where, d
        r, i = where[0]
        assert ds.position_ids[r, i : i + len(d)].tolist() == list(range(len(d)))


def test_little_data_is_one_padded_row(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "Hello"}])
    n = len(enc(tok, "Hello")) + 2
    ds, stats = load_dataset(path, tok, 64)
    assert (stats.rows, stats.tokens, stats.padding_tokens) == (1, n, 64 - n)
    assert (ds.labels[0, n:] == IGNORE_INDEX).all() and (ds.input_ids[0, n:] == tok.pad_token_id).all()
    with pytest.raises(DataError, match="fewer than one batch of 2"):
        next(ds.batches(2, seed=0, epoch=0))


def test_pack_rejects_bad_seq_len():
    with pytest.raises(ValueError):
        pack([([1, 2], [1, 2])], 0)


# --------------------------------------------------------------------------- batching


def make_ds(rows: int = 23, seq_len: int = 4) -> PackedDataset:
    ids = torch.arange(rows * seq_len).view(rows, seq_len)
    return PackedDataset(ids, ids.clone())


def row_ids(batches) -> list[list[int]]:
    return [(b["input_ids"][:, 0] // 4).tolist() for b in batches]


def test_batches_shapes_and_drop_last():
    ds = make_ds()
    batches = list(ds.batches(5, seed=0, epoch=0))
    assert ds.num_batches(5) == len(batches) == 4
    for b in batches:
        assert set(b) == {"input_ids", "labels", "attention_mask"}
        assert b["input_ids"].shape == b["labels"].shape == b["attention_mask"].shape == (5, 4)
        assert b["input_ids"].dtype == torch.int64
        assert torch.equal(b["attention_mask"], torch.ones(5, 4, dtype=torch.int64))
        assert torch.equal(b["input_ids"], b["labels"])
    seen = sum(row_ids(batches), [])
    assert len(set(seen)) == 20  # no row twice within an epoch


def test_batch_order_deterministic_and_seed_epoch_dependent():
    ds = make_ds()
    a = row_ids(ds.batches(4, seed=1, epoch=0))
    assert a == row_ids(ds.batches(4, seed=1, epoch=0))
    assert a != row_ids(ds.batches(4, seed=2, epoch=0))
    assert a != row_ids(ds.batches(4, seed=1, epoch=1))
    assert row_ids(ds.batches(4, seed=0, epoch=1)) != row_ids(ds.batches(4, seed=1, epoch=0))


@pytest.mark.parametrize("start", [0, 1, 3, 5])
def test_start_batch_resumes_at_exact_position(start):
    ds = make_ds()
    full = list(ds.batches(4, seed=3, epoch=2))
    resumed = list(ds.batches(4, seed=3, epoch=2, start_batch=start))
    assert len(resumed) == len(full) - start
    for x, y in zip(full[start:], resumed):
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_batch_argument_errors():
    ds = make_ds(rows=3)
    with pytest.raises(DataError, match="3 rows"):
        next(ds.batches(4, seed=0, epoch=0))
    with pytest.raises(ValueError):
        next(ds.batches(2, seed=0, epoch=0, start_batch=2))
    with pytest.raises(ValueError):
        ds.num_batches(0)


# --------------------------------------------------------------------------- errors


MSG_OK = {"role": "user", "content": "hi"}
BAD_LINES = [
    ('{"text": "a",}', r"invalid JSON \(Expecting property name enclosed in double quotes\)"),
    ('{"text": "a" "b"}', r"invalid JSON \(Expecting ',' delimiter\)"),
    ("[1, 2]", "expected a JSON object, got array"),
    ('"just a string"', "expected a JSON object, got string"),
    ('{"txt": "typo"}', "no 'text', 'prompt'/'completion' or 'messages' field"),
    ('{"text": 5}', "'text' must be a string, got number"),
    ('{"text": null}', "'text' must be a string, got null"),
    ('{"text": "   "}', "'text' is empty"),
    ('{"text": "\\ud800"}', "'text' contains invalid Unicode"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_bad_text_line_reports_file_and_line(tmp_path, tok, line, message):
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": "Hello"}, "", {"text": "world"}, line, {"text": "x"}])
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path))}/data\.jsonl:4: {message}"):
        load_dataset(path, tok, 1)
    ds, stats = load_dataset(path, tok, 1, skip_bad_lines=True)
    assert (stats.records, stats.bad_lines_skipped) == (3, 1)


def test_invalid_utf8_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: invalid UTF-8"):
        read_jsonl(path)


BAD_PC = [
    ({"prompt": "q"}, "missing 'completion' field"),
    ({"completion": "a"}, "missing 'prompt' field"),
    ({"prompt": "q", "completion": ""}, "'completion' is empty"),
    ({"prompt": ["q"], "completion": "a"}, "'prompt' must be a string, got array"),
]


@pytest.mark.parametrize(("record", "message"), BAD_PC)
def test_bad_prompt_completion_line(tmp_path, tok, record, message):
    good = {"prompt": "q", "completion": "a"}
    path = write_jsonl(tmp_path / "pc.jsonl", [good, good, record])
    with pytest.raises(DataError, match=rf"pc\.jsonl:3: {message}"):
        load_dataset(path, tok, 1)
    assert load_dataset(path, tok, 1, skip_bad_lines=True)[1].bad_lines_skipped == 1


BAD_CHAT = [
    ({"messages": []}, "'messages' must be a non-empty array"),
    ({"messages": "hi"}, "'messages' must be a non-empty array"),
    ({"messages": [MSG_OK, "x"]}, r"messages\[1\] must be an object"),
    ({"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\] has unknown role 'bot'"),
    ({"messages": [{"role": 3, "content": "x"}]}, r"messages\[0\] has unknown role number"),
    ({"messages": [{"content": "x"}]}, r"messages\[0\] has no 'role'"),
    ({"messages": [MSG_OK, {"role": "assistant"}]}, r"messages\[1\] has no 'content'"),
    ({"messages": [MSG_OK, {"role": "assistant", "content": None}]}, r"messages\[1\] 'content' must be a string, got null"),
    ({"messages": [MSG_OK, {"role": "assistant", "content": [{"type": "text"}]}]}, r"messages\[1\] 'content' must be a string, got array"),
    ({"messages": [MSG_OK]}, "'messages' has no assistant message"),
]


@pytest.mark.parametrize(("record", "message"), BAD_CHAT)
def test_bad_chat_line(tmp_path, tok, record, message):
    good = {"messages": [MSG_OK, {"role": "assistant", "content": "Hello"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [good, record, good])
    with pytest.raises(DataError, match=rf"c\.jsonl:2: {message}"):
        load_dataset(path, tok, 1)
    assert load_dataset(path, tok, 1, skip_bad_lines=True)[1].bad_lines_skipped == 1


def test_mixed_formats_is_an_error_even_when_skipping(tmp_path, tok):
    path = write_jsonl(tmp_path / "m.jsonl", ["{bad", {"text": "Hello"}, {"prompt": "q", "completion": "a"}])
    for skip in (False, True):
        with pytest.raises(DataError, match=r"m\.jsonl:(1|3)"):
            load_dataset(path, tok, 1, skip_bad_lines=skip)
    with pytest.raises(DataError, match=r"m\.jsonl:3: record is 'prompt_completion' but the file is 'text' \(from line 2\)"):
        load_dataset(path, tok, 1, skip_bad_lines=True)


def test_first_bad_line_skipped_then_format_from_first_valid(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"text": 1}', {"prompt": "q", "completion": " a"}])
    _, stats = load_dataset(path, tok, 1, skip_bad_lines=True)
    assert (stats.format, stats.records, stats.bad_lines_skipped) == ("prompt_completion", 1, 1)


def test_empty_files(tmp_path, tok):
    for name, content in [("e.jsonl", ""), ("w.jsonl", "\n  \n"), ("e.txt", " \n\n")]:
        path = tmp_path / name
        path.write_text(content)
        with pytest.raises(DataError, match=rf"{name}: (no usable records|file is empty)"):
            load_dataset(path, tok, 1)


def test_all_lines_bad_in_skip_mode(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", ["{", "[]"])
    with pytest.raises(DataError, match=r"d\.jsonl: no usable records \(2 bad lines skipped\)"):
        load_dataset(path, tok, 1, skip_bad_lines=True)


@pytest.mark.parametrize("name", ["nope.jsonl", "nope.txt", "nope.csv"])
def test_missing_file(tmp_path, tok, name):
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path / name))}: file not found$"):
        load_dataset(tmp_path / name, tok, 8)


def test_unknown_extension(tmp_path, tok):
    path = tmp_path / "data.csv"
    path.write_text("text\nhello\n")
    with pytest.raises(DataError, match=r"data\.csv: unsupported file type '\.csv'"):
        load_dataset(path, tok, 8)


def test_error_messages_are_one_line(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"messages": [{"role": "a\nb" * 50, "content": "x"}]}])
    with pytest.raises(DataError) as info:
        load_dataset(path, tok, 1)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TinypipeError)


# --------------------------------------------------------------------------- fuzzing

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
field_names = st.sampled_from(["text", "prompt", "completion", "messages", "role", "content", "id"])
record_like = st.dictionaries(
    field_names,
    json_values | st.lists(st.dictionaries(st.sampled_from(["role", "content"]), st.sampled_from(["user", "assistant", "bot"]) | json_values)),
    max_size=3,
)
fuzz_line = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")),
    record_like.map(lambda r: json.dumps(r).encode()),
    st.sampled_from(string.printable).map(str.encode),
)


@FUZZ
@given(lines=st.lists(fuzz_line, min_size=1, max_size=6), skip=st.booleans())
def test_fuzz_reader_only_raises_data_error(tok, lines, skip):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.jsonl"
        path.write_bytes(b"\n".join(lines))
        try:
            load_dataset(path, tok, 2, skip_bad_lines=skip)
        except DataError as err:
            assert "\n" not in str(err)


printable = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30).filter(str.strip)


@FUZZ
@given(texts=st.lists(printable, min_size=1, max_size=8), seq_len=st.integers(1, 16), packing=st.booleans())
def test_fuzz_text_round_trip(tok, texts, seq_len, packing):
    from test_packing import check_rows

    pairs = []
    for t in texts:
        ids = [*tok(t)["input_ids"], tok.eos_token_id]
        pairs.append((ids, ids))
    with tempfile.TemporaryDirectory() as d:
        path = write_jsonl(Path(d) / "t.jsonl", [{"text": t} for t in texts])
        ds, stats = load_dataset(path, tok, seq_len, packing=packing)
    check_rows(ds, stats, pairs, seq_len, packing, tok.pad_token_id)


@FUZZ
@given(pairs=st.lists(st.tuples(printable, printable), min_size=1, max_size=5))
def test_fuzz_prompt_completion_round_trip(tok, pairs):
    with tempfile.TemporaryDirectory() as d:
        path = write_jsonl(Path(d) / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in pairs])
        ds, stats = load_dataset(path, tok, 1)
    ids, labels = flat(ds)
    expected_ids, expected_labels = [], []
    for p, c in pairs:
        p_ids, c_ids = tok(p)["input_ids"], [*enc(tok, c), tok.eos_token_id]
        expected_ids += p_ids + c_ids
        expected_labels += [IGNORE_INDEX] * len(p_ids) + c_ids
    assert (ids, labels) == (expected_ids, expected_labels)


chat_content = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)


@FUZZ
@given(turns=st.lists(st.tuples(chat_content, chat_content), min_size=1, max_size=4), system=st.booleans())
def test_fuzz_chat_round_trip(tok, turns, system):
    messages = [{"role": "system", "content": "Be brief."}] if system else []
    for question, answer in turns:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    with tempfile.TemporaryDirectory() as d:
        path = write_jsonl(Path(d) / "c.jsonl", [{"messages": messages}])
        ds, _ = load_dataset(path, tok, 1)
    ids, labels = flat(ds)
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False) + tok.eos_token
    assert _assistant_text(tok, labels) == "".join(a for _, a in turns)


def test_document_tokens_is_the_token_weighted_mean_document_length():
    """What the planner prices attention by (Config.document_tokens): rows of 8 hold documents of
    5 and 3, 6 and a 2-token padding tail, one of 8 -> (25 + 9 + 36 + 4 + 64) / 24 tokens; one
    document per row (no packing) is the row's length."""
    docs = [(list(range(1, n + 1)), list(range(1, n + 1))) for n in (5, 3, 6, 8)]
    packed, _ = pack(docs, 8, packing=True, pad_id=0)
    assert len(packed) == 3
    assert packed.document_tokens() == round((25 + 9 + 36 + 4 + 64) / 24)
    unpacked, _ = pack(docs, 8, packing=False, pad_id=0)
    assert unpacked.document_tokens() == 8
