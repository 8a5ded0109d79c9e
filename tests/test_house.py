"""House rules for the package's source that no linter checks (issue #33).

- The code says *why*, in plain words; measurement history (which working session measured what,
  on which benchmark run) lives in ``bench/RESULTS.md`` and ``docs/measured.md`` with the raw files.
- A module has one job: over :data:`MAX_MODULE_LINES` lines it says at its top why it is one module,
  in a docstring line starting with :data:`ONE_MODULE_BECAUSE`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "tinypipe"
SESSION = re.compile(r"\bsessions?\s+\d+", re.IGNORECASE)
MAX_MODULE_LINES = 600
ONE_MODULE_BECAUSE = "One module because"


def session_references(root: Path) -> list[str]:
    """``path:line: text`` of every line under ``root`` that names a numbered working session."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if SESSION.search(line):
                found.append(f"{path.relative_to(root.parent).as_posix()}:{n}: {line.strip()}")
    return found


def long_modules(root: Path, limit: int = MAX_MODULE_LINES) -> list[str]:
    """``path: N lines`` of every module under ``root`` over ``limit`` lines whose docstring has no
    line starting with :data:`ONE_MODULE_BECAUSE`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines <= limit:
            continue
        doc = ast.get_docstring(ast.parse(text, filename=str(path))) or ""
        if not any(line.strip().startswith(ONE_MODULE_BECAUSE) for line in doc.splitlines()):
            found.append(f"{path.relative_to(root.parent).as_posix()}: {lines} lines")
    return found


def test_no_session_history_in_the_package() -> None:
    found = session_references(PACKAGE)
    assert not found, ("measurement history belongs in bench/RESULTS.md or docs/measured.md (with its "
                       "raw files); say why in plain words here:\n" + "\n".join(found))


def test_long_modules_say_why_they_are_one() -> None:
    found = long_modules(PACKAGE)
    assert not found, (f"modules over {MAX_MODULE_LINES} lines: split them by job, or start a line of "
                       f"the module docstring with '{ONE_MODULE_BECAUSE} ...':\n" + "\n".join(found))


# ------------------------------------------------------------------------------- the checkers themselves


def test_checkers_find_what_they_look_for(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text('"""Fitted in Session 14 on W1."""\nX = 1  # sessions 7-9\nY = 2  # the session\n')
    (pkg / "long.py").write_text('"""A long module."""\n' + "x = 1\n" * 10)
    (pkg / "said.py").write_text('"""A long module.\n\nOne module because its parts share state.\n"""\n'
                                 + "x = 1\n" * 10)
    assert session_references(pkg) == ["pkg/a.py:1: \"\"\"Fitted in Session 14 on W1.\"\"\"",
                                        "pkg/a.py:2: X = 1  # sessions 7-9"]
    assert long_modules(pkg, limit=5) == ["pkg/long.py: 11 lines"]
