"""House style the package keeps: no line over :data:`MAX_LINE` characters (``[tool.ruff]
line-length`` in pyproject.toml says the same to the linter)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINE = 110

ALLOWED_LONG: set[str] = set()  # every file of the package keeps the limit


def _allowed(rel: str) -> bool:
    return any(rel == a or (a.endswith("/*") and rel.startswith(a[:-1])) for a in ALLOWED_LONG)


def test_no_line_over_the_limit() -> None:
    long = []
    for path in sorted((REPO / "tinypipe").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if _allowed(rel):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if len(line) > MAX_LINE:
                long.append(f"{rel}:{n}: {len(line)} characters")
    assert not long, f"lines over {MAX_LINE} characters:\n" + "\n".join(long)


def test_the_limit_is_the_linters() -> None:
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    section = re.search(r"^\[tool\.ruff\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert section is not None, "pyproject.toml has no [tool.ruff] section"
    assert re.search(rf"^line-length\s*=\s*{MAX_LINE}\s*$", section.group(1), re.M)


def test_allowed_files_exist() -> None:
    """An entry for a file that moved or was deleted would silently allow nothing; drop it."""
    stale = [a for a in ALLOWED_LONG
             if not (a.endswith("/*") and (REPO / a[:-2]).is_dir()) and not (REPO / a).is_file()]
    assert not stale, f"ALLOWED_LONG names files that do not exist: {stale}"
