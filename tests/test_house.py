"""House rules for the package's source that no linter checks (issue #33).

- The code says *why*, in plain words; measurement history (which working session measured what,
  on which benchmark run) lives in ``bench/RESULTS.md`` and ``docs/measured.md`` with the raw files.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "tinypipe"
SESSION = re.compile(r"\bsessions?\s+\d+", re.IGNORECASE)


def session_references(root: Path) -> list[str]:
    """``path:line: text`` of every line under ``root`` that names a numbered working session."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if SESSION.search(line):
                found.append(f"{path.relative_to(root.parent).as_posix()}:{n}: {line.strip()}")
    return found


def test_no_session_history_in_the_package() -> None:
    found = session_references(PACKAGE)
    assert not found, ("measurement history belongs in bench/RESULTS.md or docs/measured.md (with its "
                       "raw files); say why in plain words here:\n" + "\n".join(found))


# ------------------------------------------------------------------------------- the checkers themselves


def test_checkers_find_what_they_look_for(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text('"""Fitted in Session 14 on W1."""\nX = 1  # sessions 7-9\nY = 2  # the session\n')
    assert session_references(pkg) == ["pkg/a.py:1: \"\"\"Fitted in Session 14 on W1.\"\"\"",
                                        "pkg/a.py:2: X = 1  # sessions 7-9"]
