"""House rules for the package's source that no linter checks (issue #33).

- The code says *why*, in plain words; measurement history (which working session measured what,
  on which benchmark run) lives in ``bench/RESULTS.md`` and ``docs/measured.md`` with the raw files.
- A module has one job: over :data:`MAX_MODULE_LINES` lines it says at its top why it is one module,
  in a docstring line starting with :data:`ONE_MODULE_BECAUSE`.
- The optimizer's step counters (a layer state's ``step``, the optimizer path's ``step_count`` and
  ``last_clipped``) are set only in :data:`COUNTER_HOMES`; a checkpoint loader restores them through
  ``runtime/optim/counters.py: set_layer_step`` and ``OptimizerPath.restore_counters``.
- Task ids and lanes are data (``schedule/ids.py``: ``TaskId``, ``Lane``); the package parses their
  text back only in :data:`PARSE_HOMES` -- never on a step's path.
- A module's private names (``_x``) are its own: another module that needs one gets a public name
  (an alias *to* a private name, ``import x as _x``, is the importer's own business).
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
COUNTER_HOMES = ("runtime/optim/",)  # package-relative folders where the step counters may be set
ENGINE_COUNTERS = frozenset({"step_count", "last_clipped"})
LAYER_STATE_CLASSES = frozenset({"LayerState", "SliceState"})  # ``self.step`` in these is the counter
#: modules (package-relative) that may parse a task id's or a lane's text: the parser, and the plot
#: of the last step's lanes, which reads the timeline's text
PARSE_HOMES = ("schedule/ids.py", "train/plots.py")


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


class _CounterWrites(ast.NodeVisitor):
    """Assignments (plain, augmented, annotated, tuple targets, ``setattr`` with a constant name) to
    a step counter: ``<x>.step`` unless ``x`` is ``self`` of a class other than a layer state (its own
    attribute, e.g. a training record's step), and ``<x>.step_count`` / ``<x>.last_clipped``."""

    def __init__(self) -> None:
        self.lines: list[int] = []
        self._classes: list[str] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._classes.append(node.name)
        self.generic_visit(node)
        self._classes.pop()

    def _counter(self, owner: ast.expr, attr: str) -> bool:
        if attr in ENGINE_COUNTERS:
            return True
        if attr != "step":
            return False
        own = isinstance(owner, ast.Name) and owner.id == "self"
        return not own or bool(self._classes and self._classes[-1] in LAYER_STATE_CLASSES)

    def _target(self, node: ast.expr) -> None:
        if isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                self._target(elt)
        elif isinstance(node, ast.Starred):
            self._target(node.value)
        elif isinstance(node, ast.Attribute) and self._counter(node.value, node.attr):
            self.lines.append(node.lineno)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._target(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._target(node.target)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._target(node.target)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func, args = node.func, node.args
        if (isinstance(func, ast.Name) and func.id == "setattr" and len(args) == 3
                and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str)
                and self._counter(args[0], args[1].value)):
            self.lines.append(node.lineno)
        self.generic_visit(node)


def counter_writes(root: Path, homes: tuple[str, ...] = COUNTER_HOMES) -> list[str]:
    """``path:line: text`` of every assignment to a step counter in a module under ``root`` outside
    ``homes`` (folders relative to ``root``, with a trailing slash)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(rel.startswith(home) for home in homes):
            continue
        text = path.read_text(encoding="utf-8")
        visitor = _CounterWrites()
        visitor.visit(ast.parse(text, filename=str(path)))
        lines = text.splitlines()
        for n in visitor.lines:
            found.append(f"{path.relative_to(root.parent).as_posix()}:{n}: {lines[n - 1].strip()}")
    return found


def id_parsing(root: Path, homes: tuple[str, ...] = PARSE_HOMES) -> list[str]:
    """``path:line: text`` of every ``TaskId.parse`` / ``Lane.parse`` call in a module under ``root``
    other than ``homes`` (paths relative to ``root``)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() in homes:
            continue
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text, filename=str(path))):
            func = node.func if isinstance(node, ast.Call) else None
            if (isinstance(func, ast.Attribute) and func.attr == "parse" and isinstance(func.value, ast.Name)
                    and func.value.id in ("TaskId", "Lane")):
                found.append(f"{path.relative_to(root.parent).as_posix()}:{node.lineno}: "
                             f"{lines[node.lineno - 1].strip()}")
    return found


def private_imports(root: Path) -> list[str]:
    """``path:line: module._name`` of every import, anywhere in a module under ``root`` (function
    bodies too), of a private name from another module of the package."""
    found = []
    pkg = root.name
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = node.module or ""
            if node.level == 0 and module != pkg and not module.startswith(pkg + "."):
                continue  # another library's
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(root.parent).as_posix()}:{node.lineno}: "
                                 f"{'.' * node.level}{module}.{alias.name}")
    return found


def test_no_private_names_cross_modules() -> None:
    found = private_imports(PACKAGE)
    assert not found, ("a private name imported from another module: give it a public name where it "
                       "lives:\n" + "\n".join(found))


def test_step_counters_change_only_in_the_optimizer() -> None:
    found = counter_writes(PACKAGE)
    assert not found, ("the optimizer's step counters change only in tinypipe/runtime/optim (a checkpoint "
                       "restores them through set_layer_step / OptimizerPath.restore_counters):\n"
                       + "\n".join(found))


def test_task_ids_and_lanes_are_not_parsed_on_the_step() -> None:
    found = id_parsing(PACKAGE)
    assert not found, ("the schedule is keyed by TaskId / Lane: use their fields; text is parsed back only "
                       f"in {', '.join(PARSE_HOMES)}:\n" + "\n".join(found))


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


def test_private_import_checker_finds_them_in_functions_too(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("from pkg.b import public, _private\nfrom torch import _C\n"
                              "from pkg.b import helper as _helper\nfrom pkg import __version__\n"
                              "def f():\n    from .b import _late\n")
    assert private_imports(pkg) == ["pkg/a.py:1: pkg.b._private", "pkg/a.py:6: .b._late"]


def test_counter_checker_finds_every_kind_of_write(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "runtime" / "optim").mkdir(parents=True)
    (pkg / "runtime" / "optim" / "ok.py").write_text("state.step += 1\npath.step_count = 0\n")
    (pkg / "loader.py").write_text(
        "s.step = int(e['step'])  # s.step = 1 in a comment is no write\n"
        "engine.optimizer.step_count, extra = loaded\n"
        "opt.last_clipped: bool = False\n"
        "setattr(s, 'step', 3)\n"
        "layers[0].step -= 1\n"
        "n = s.step + 1\n"
        "class Record:\n"
        "    def __init__(self, step):\n"
        "        self.step = step\n"
        "class LayerState:\n"
        "    def bump(self):\n"
        "        self.step += 1\n")
    assert [line.split(":")[1] for line in counter_writes(pkg)] == ["1", "2", "3", "4", "5", "12"]


def test_parse_checker_finds_calls_outside_its_homes(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "schedule").mkdir(parents=True)
    (pkg / "schedule" / "ids.py").write_text("x = Lane.parse('dev0:h2d')\n")
    (pkg / "step.py").write_text("lane = Lane.parse(name)\n# TaskId.parse(t) in a comment\n"
                                 "kind = TaskId.parse(t).kind\nplan = Plan.parse(p)\n")
    assert id_parsing(pkg, homes=("schedule/ids.py",)) == ["pkg/step.py:1: lane = Lane.parse(name)",
                                                          "pkg/step.py:3: kind = TaskId.parse(t).kind"]
