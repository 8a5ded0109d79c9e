"""Read safetensors files one tensor at a time with plain file reads, straight into place.

The format is an 8-byte little-endian header length, a JSON header mapping each name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (relative to the end of the header), then the
raw little-endian data. ``safetensors.safe_open`` memory-maps the whole file: every page a read
touches stays in the process's resident set (file-backed) until the file is closed, so reading a
shard through it adds the shard's size to peak RSS. Reading with ``readinto`` goes through the
page cache, which is not the process's memory, and an fp32 tensor lands directly in its
destination with no temporary at all; other dtypes use one temporary of the tensor's size.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tinypipe.safe_paths import inside

__all__ = ["TensorEntry", "read_header", "read_tensor", "safetensors_files"]

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)

_HEADER_LIMIT = 100 * 1024 * 1024
_CHUNK = 64 * 1024 * 1024  # bytes per readinto call


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsError(ValueError):
    """A safetensors file is malformed (one-line message naming the file)."""


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a model directory: the index's shards, ``model.safetensors`` or all
    ``*.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SafetensorsError(
                f"{index}: cannot read the shard index ({type(exc).__name__}: {exc})") from None
        files = [inside(folder, name, index) for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise SafetensorsError(f"{index}: lists shard {f.name}, which is missing")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    return sorted(folder.glob("*.safetensors"))


def read_header(file: Path) -> list[TensorEntry]:
    """The tensors of one file, in file order (no tensor data is read)."""
    with open(file, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{file}: truncated safetensors file (no header)")
        (length,) = struct.unpack("<Q", raw)
        if length > _HEADER_LIMIT:
            raise SafetensorsError(f"{file}: not a safetensors file (header length {length})")
        raw = fh.read(length)
        if len(raw) != length:
            raise SafetensorsError(f"{file}: corrupt safetensors header (truncated: {len(raw)} of its "
                                   f"{length} bytes present)")
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            why = " ".join(str(exc).split())[:120]
            raise SafetensorsError(f"{file}: corrupt safetensors header ({why})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{file}: corrupt safetensors header (not a JSON object)")
    size = file.stat().st_size
    base = 8 + length
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out.append(_entry(file, name, info, base, size))
    out.sort(key=lambda e: e.start)
    return out


def _entry(file: Path, name: str, info: object, base: int, size: int) -> TensorEntry:
    """One header entry, checked: known dtype, non-negative integer shape, a data range inside the
    file whose length matches the shape (a malformed entry is a one-line error naming it)."""
    bad = f"{file}: tensor {name!r}:"
    if not isinstance(info, dict):
        raise SafetensorsError(f"{bad} malformed header entry")
    dtype = DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
    if dtype is None:
        raise SafetensorsError(f"{bad} unsupported or missing dtype {info.get('dtype')!r}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise SafetensorsError(f"{bad} malformed shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(x) is int and x >= 0 for x in offsets)):
        raise SafetensorsError(f"{bad} malformed data_offsets {offsets!r}")
    numel = 1
    for d in shape:
        numel *= d
    begin, end = offsets
    itemsize = torch.empty((), dtype=dtype).element_size()
    if end - begin != numel * itemsize or base + end > size:
        raise SafetensorsError(f"{bad} data range does not match its shape (truncated file?)")
    return TensorEntry(file, name, dtype, tuple(shape), base + begin, end - begin)


def _readinto(fh, out: torch.Tensor, entry: TensorEntry) -> None:  # noqa: ANN001
    flat = out.reshape(-1).view(torch.uint8)
    view = memoryview(flat.numpy())
    fh.seek(entry.start)
    done = 0
    while done < entry.nbytes:
        n = fh.readinto(view[done : min(done + _CHUNK, entry.nbytes)])
        if not n:
            raise SafetensorsError(f"{entry.file}: tensor {entry.name!r}: unexpected end of file")
        done += n


def read_tensor(fh, entry: TensorEntry,  # noqa: ANN001
                target: torch.Tensor | None = None) -> torch.Tensor | None:
    """Read ``entry`` from open file ``fh``.

    With a contiguous CPU ``target`` of the same dtype and size, the bytes are read straight into
    it and ``None`` is returned. Otherwise a new tensor of the stored dtype and shape is returned.
    """
    if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts to test on
        raise SafetensorsError("reading safetensors on a big-endian host is not supported")
    if (
        target is not None
        and target.dtype == entry.dtype
        and target.is_contiguous()
        and target.device.type == "cpu"
        and tuple(target.shape) == entry.shape
    ):
        _readinto(fh, target, entry)
        return None
    out = torch.empty(entry.shape, dtype=entry.dtype)
    if entry.nbytes:
        _readinto(fh, out, entry)
    return out
