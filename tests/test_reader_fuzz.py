"""Fuzzing the readers of user files (GGUF, safetensors, JSONL) with hypothesis.

Whatever the bytes -- truncated files, wrong magic, wrong sizes or dtypes, absurd declared lengths --
a reader either returns consistent data or raises the one-line error type the CLI shows with exit
code 2 (a :class:`~tinypipe.errors.TinypipeError`); never ``struct.error``, ``KeyError``, a
``MemoryError`` from a declared length, or a traceback.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinypipe.errors import TinypipeError
from tinypipe.models.safetensors_stream import SafetensorsError, read_header
from tinypipe.train.records import DataError, read_jsonl

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _valid_safetensors() -> bytes:
    from safetensors.torch import save

    return save({"a.weight": torch.arange(12, dtype=torch.float32).view(3, 4),
                 "b.bias": torch.ones(5, dtype=torch.bfloat16)})


def _read(tmp_path: Path, blob: bytes, name: str = "model.safetensors"):
    f = tmp_path / name
    f.write_bytes(blob)
    return f


def _check_entries(f: Path, entries) -> None:
    size = f.stat().st_size
    for e in entries:
        assert 0 <= e.start and e.start + e.nbytes <= size
        numel = 1
        for d in e.shape:
            assert d >= 0
            numel *= d
        assert e.nbytes == numel * torch.empty((), dtype=e.dtype).element_size()


@FUZZ
@given(cut=st.integers(min_value=0, max_value=400))
def test_truncated_safetensors_is_a_one_line_error(tmp_path: Path, cut: int) -> None:
    blob = _valid_safetensors()
    f = _read(tmp_path, blob[: min(cut, len(blob) - 1)])
    with pytest.raises(SafetensorsError) as err:
        read_header(f)
    assert "\n" not in str(err.value)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_entry = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "BF16", "F16", "I64", "U8", "Q4", ""]) | _json,
    "shape": st.lists(st.integers(min_value=-3, max_value=2**40), max_size=3) | _json,
    "data_offsets": st.lists(st.integers(min_value=-10, max_value=2**40), max_size=3) | _json,
})


@FUZZ
@given(header=st.dictionaries(st.text(max_size=6), _entry | _json, max_size=4) | _json,
       payload=st.binary(max_size=64))
def test_arbitrary_safetensors_headers_are_read_or_refused(tmp_path: Path, header, payload: bytes) -> None:
    raw = json.dumps(header).encode()
    f = _read(tmp_path, struct.pack("<Q", len(raw)) + raw + payload)
    try:
        entries = read_header(f)
    except SafetensorsError as exc:
        assert "\n" not in str(exc)
        return
    _check_entries(f, entries)


@FUZZ
@given(length=st.integers(min_value=0, max_value=2**64 - 1), tail=st.binary(max_size=32))
def test_any_declared_header_length_is_read_or_refused(tmp_path: Path, length: int, tail: bytes) -> None:
    f = _read(tmp_path, struct.pack("<Q", length) + tail)
    try:
        entries = read_header(f)  # e.g. length 2 + b"{}": a valid file without tensors
    except SafetensorsError as exc:
        assert "\n" not in str(exc)
        return
    assert length <= len(tail)
    _check_entries(f, entries)


# ------------------------------------------------------------------ GGUF


def _tiny_gguf(path: Path) -> bytes:
    """A real GGUF file (gguf's own writer) of a 1-layer llama with a 32-token vocabulary."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(32)])
    w.add_token_scores([0.0] * 32)
    w.add_token_types([1] * 32)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((32, 16), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


class _Blob(bytes):
    def __repr__(self) -> str:  # hypothesis prints fixtures of failing cases: not 2 KB of bytes
        return f"<GGUF file, {len(self)} bytes>"


@pytest.fixture(scope="module")
def gguf_blob(tmp_path_factory) -> bytes:
    pytest.importorskip("gguf")
    return _Blob(_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


def _load_gguf_file(f: Path) -> None:
    import tinypipe

    tinypipe.load_model(f)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=4, max_value=4000))
def test_truncated_gguf_is_a_one_line_error(tmp_path: Path, gguf_blob: bytes, cut: int) -> None:
    f = _read(tmp_path, gguf_blob[: min(cut, len(gguf_blob) - 1)], "m.gguf")
    with pytest.raises(TinypipeError) as err:
        _load_gguf_file(f)
    assert "\n" not in str(err.value)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_gguf_header_is_refused_in_one_line(tmp_path: Path, gguf_blob: bytes, data) -> None:
    blob = bytearray(gguf_blob)
    # overwrite counts / lengths in the header region with arbitrary (often huge) values
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        at = data.draw(st.integers(min_value=4, max_value=min(600, len(blob) - 8)))
        blob[at : at + 8] = struct.pack("<Q", data.draw(st.integers(min_value=0, max_value=2**64 - 1)))
    f = _read(tmp_path, bytes(blob), "m.gguf")
    try:
        _load_gguf_file(f)
    except TinypipeError as exc:
        assert "\n" not in str(exc)


def test_gguf_with_valid_magic_and_truncated_header_exits_2(tmp_path: Path, capsys) -> None:
    from tinypipe.cli import main

    f = _read(tmp_path, b"GGUF\x03\x00\x00\x00\x05\x00", "m.gguf")
    data = tmp_path / "d.txt"
    data.write_text("hello world " * 50)
    code = main(["finetune", "--model", str(f), "--data", str(data), "--output", str(tmp_path / "out"),
                 "--steps", "1"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "m.gguf" in err[0], err


# ------------------------------------------------------------------ JSONL


@FUZZ
@given(lines=st.lists(st.binary(max_size=40) | _json.map(lambda v: json.dumps(v).encode()), min_size=1, max_size=6))
def test_arbitrary_jsonl_is_read_or_refused(tmp_path: Path, lines: list[bytes]) -> None:
    f = _read(tmp_path, b"\n".join(lines), "d.jsonl")
    try:
        fmt, examples, skipped = read_jsonl(f)
    except DataError as exc:
        assert "\n" not in str(exc)
        return
    assert examples and skipped == 0 and fmt in ("text", "prompt_completion", "chat")


def test_inconsistent_config_json_is_a_one_line_error(tmp_path: Path) -> None:
    """transformers 5 validates configs with huggingface_hub's strict dataclasses (not ValueError)."""
    import tinypipe
    from safetensors.torch import save_file

    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16,
           "num_attention_heads": 3, "num_key_value_heads": 3, "intermediate_size": 32,
           "num_hidden_layers": 1, "vocab_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(TinypipeError) as err:
        tinypipe.load_model(tmp_path)
    assert "config.json" in str(err.value) and "\n" not in str(err.value)
