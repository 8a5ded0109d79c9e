"""Byte sizes as people write and read them: ``"24GiB"`` in, ``"12.3 GiB"`` out.

The lowest layer of the package (it imports only the error types), so the configuration, the
planner and the memory report can all use it without importing each other.
"""

from __future__ import annotations

import re

from tinypipe.errors import ConfigError

GIB = 1024**3

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}


def parse_bytes(text: str | int | float) -> int:
    """``"24GiB"``, ``"24G"``, ``"24000MB"``, ``"1.5TiB"`` or a number of bytes -> bytes.

    ``G``/``GB`` are decimal (10^9), ``GiB`` binary (2^30), as on datasheets and in ``free -g``
    respectively.
    """
    if isinstance(text, bool):
        raise ConfigError(f"expected a size such as 24GiB, got {text!r}")
    if isinstance(text, (int, float)):
        if text <= 0:
            raise ConfigError(f"size must be positive, got {text}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read size {text!r}; write e.g. 24GiB, 24G, 24000MB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ConfigError(f"size must be positive, got {text!r}")
    return int(value)


def fmt_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches, two decimals (memory reports)."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def gib_text(n: float) -> str:
    """``n`` bytes as '12.3 GiB' (plan messages)."""
    return f"{n / GIB:.1f} GiB"


def gib_pair(need: float, have: float) -> tuple[str, str]:
    """``need`` and ``have`` bytes as GiB texts with just enough digits to differ when they do
    ("needs 3.0 GiB, have 3.0 GiB" told the user nothing): one decimal, up to four."""
    for digits in range(1, 5):
        a, b = f"{need / GIB:.{digits}f} GiB", f"{have / GIB:.{digits}f} GiB"
        if a != b:
            return a, b
    return a, b
