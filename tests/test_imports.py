"""The package's import graph: no circles, and no import that goes up the layer order.

The graph is read with :mod:`ast` from the source of every module under ``tinypipe/`` and counts
every import: at the top, inside functions, and under ``if TYPE_CHECKING:`` -- a type-only import
that closes a circle still ties the two modules into one unit that cannot be understood, tested
or replaced alone. ``from tinypipe.x import y`` is an edge to ``tinypipe.x.y`` when that is a module,
else to ``tinypipe.x``. Importing ``tinypipe.a.b`` also runs ``tinypipe/a/__init__.py``: that is an
edge too, unless the importer is inside ``tinypipe.a`` (its package is already imported then). The
root facade ``tinypipe/__init__.py`` is imported before any module, so it is nobody's dependency.

The layers, lowest first (:data:`LAYERS`); a module may import its own layer and the layers below.
Each layer is placed by what it needs, never by what needs it:

- ``errors``, ``units``, ``write_errors``, ``safe_paths``, ``documented``: the words everyone uses (the
  error hierarchy, byte sizes, failed writes as one line, file names read from files kept inside their
  folder, dataclass fields documented where they are declared).
- ``devices``: the machine -- the :class:`~tinypipe.devices.backend.Backend` interface,
  page-aligned host buffers it can pin, and its measured rates (``rates.py``: ``tinypipe profile``).
  The benchmarks' own helpers (workloads, bounds, RSS sampling) live outside the package, in
  ``bench/benchkit/``.
- ``models``: a Hugging Face model as a sequence of layers (decomposition, device shells,
  streaming loaders into the host layout, skeletons, export). A model holding quantized weights
  is laid out and copied with helpers the runtime hands in (``models/quant_hooks.py``).
- ``quant``: quantized frozen weights in the decomposition's layout (so above models), and the
  helpers the runtime hands the model layer (``quant/hooks.py``).
- ``memory``, ``storage``: where training state lives -- the host copy (fp32 masters and moments
  in the decomposition's layout, so above models), gradient and device pools, budgets; the SSD tier.
- ``schedule``: the :class:`~tinypipe.schedule.plan.Plan` and the schedule built from it, as data
  (needs only errors: the planner, the config and the runtime all speak it).
- ``config``: the user's settings; its choice sets are the Plan's, so it sits above schedule.
- ``distributed``: data-parallel replicas over torch.distributed -- topology, collectives, shard
  arithmetic, the start-up fingerprint check (of a Config, so above config) and the watchdog.
- ``lora``: PEFT adapters on a model; merging reads the host store (memory) and saving takes a
  trainer through a Protocol, so lora never imports the engine above it.
- ``planner``: sizes (of LoRA models too), memory estimate, cost model, search; plans for a Config.
- ``runtime``: the engine that runs a plan; it asks the planner when it is given none.
- ``train``: the training loop, data and model loading around an engine.
- ``cli``, ``config_reference``: the ``tinypipe`` command; ``docs/configuration.md`` rendered from
  ``Config`` (it names the ``finetune`` flag that sets each field, so it sits beside the command).
- the facade ``tinypipe/__init__.py``: the public names; nothing inside the package imports it.

Every top-level module or package of ``tinypipe`` must appear here: a new one is placed on purpose.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "tinypipe"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

#: Lowest first. Names are the first component below ``tinypipe``; ``""`` is the facade itself.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "units", "write_errors", "safe_paths", "documented"),
    ("devices",),
    ("models",),
    ("quant",),
    ("memory", "storage"),
    ("schedule",),
    ("config",),
    ("distributed",),
    ("lora",),
    ("planner",),
    ("runtime",),
    ("train",),
    ("cli", "config_reference"),
    ("",),
)

#: Known edges that break the rules until another branch lands, as (importer, imported) module names.
#: Left out of the graph for both checks; an entry that no longer exists fails the test (delete it).
ALLOWED: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Edge:
    src: str  # importing module
    dst: str  # imported module (or a package whose __init__ the import runs)
    line: int
    named: str  # the module the import statement names (== dst unless dst is an implied package)

    def where(self, root: Path, package: str) -> str:
        return f"{module_path(self.src, root, package)}:{self.line}"


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package's name -> its ``__init__.py``)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def module_path(name: str, root: Path, package: str) -> str:
    return str(module_names(root, package)[name].relative_to(root.parent))


def _named_targets(node: ast.Import | ast.ImportFrom, src: str, is_package: bool,
                   modules: dict[str, Path], package: str) -> list[str]:
    """The package modules an import statement names (before packages implied by them)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:  # relative: from the importer's package, up level - 1
            here = src.split(".") if is_package else src.split(".")[:-1]
            base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = []
    for name in names:
        if name != package and not name.startswith(package + "."):
            continue
        while name not in modules:  # `import tinypipe.a.b.Name`-style spelling: the longest module
            name = name.rsplit(".", 1)[0]
        out.append(name)
    return out


def import_graph(root: Path, package: str = PACKAGE) -> list[Edge]:
    """Every import edge between the package's modules, implied package ``__init__`` runs included."""
    modules = module_names(root, package)
    edges: set[Edge] = set()
    for src, path in modules.items():
        is_package = path.name == "__init__.py"
        own = src.split(".") if is_package else src.split(".")[:-1]
        own_packages = {".".join(own[:i]) for i in range(1, len(own) + 1)}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for named in _named_targets(node, src, is_package, modules, package):
                parts = named.split(".")
                implied = [".".join(parts[:i]) for i in range(2, len(parts))]
                for dst in [named, *(p for p in implied if p not in own_packages)]:
                    if dst != src:
                        edges.add(Edge(src, dst, node.lineno, named))
    return sorted(edges, key=lambda e: (e.src, e.line, e.dst))


def without_allowed(edges: list[Edge], allowed: set[tuple[str, str]]) -> list[Edge]:
    return [e for e in edges if (e.src, e.named) not in allowed]


def cycles(edges: list[Edge]) -> list[tuple[list[str], list[Edge]]]:
    """Per strongly connected component of more than one module: its modules and one shortest
    circle through the first of them."""
    succ: dict[str, dict[str, Edge]] = {}
    for e in edges:
        succ.setdefault(e.src, {}).setdefault(e.dst, e)
        succ.setdefault(e.dst, {})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(succ) + 100))
    try:
        for v in sorted(succ):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    out = []
    for component in sorted(components):
        members, start = set(component), component[0]
        came: dict[str, Edge] = {}
        queue = deque([start])
        while queue:  # breadth first: the shortest way back to start
            v = queue.popleft()
            for w, e in sorted(succ[v].items()):
                if w not in members or w in came:
                    continue
                came[w] = e
                if w == start:
                    queue.clear()
                    break
                queue.append(w)
        circle, v = [], start
        while True:
            e = came[v]
            circle.append(e)
            v = e.src
            if v == start:
                break
        out.append((component, circle[::-1]))
    return out


def layer_of(module: str, layers: tuple[tuple[str, ...], ...], package: str = PACKAGE) -> int:
    top = module[len(package) + 1 :].split(".")[0] if module != package else ""
    for rank, names in enumerate(layers):
        if top in names:
            return rank
    raise KeyError(f"{module}: '{top}' is in no layer of LAYERS")


def upward(edges: list[Edge], layers: tuple[tuple[str, ...], ...], package: str = PACKAGE) -> list[Edge]:
    """The edges that go up; an implied package edge is in the layer of the module named, so only
    the named edges are checked (one report per import)."""
    return [e for e in edges
            if e.dst == e.named and layer_of(e.dst, layers, package) > layer_of(e.src, layers, package)]


def describe_circle(found: tuple[list[str], list[Edge]], root: Path, package: str) -> str:
    component, circle = found
    steps = [f"{e.src} ({e.where(root, package)})" for e in circle]
    return (f"{len(component)} modules import each other ({', '.join(component)}); one circle: "
            + " -> ".join([*steps, circle[0].src]))


def describe_edge(e: Edge, root: Path, package: str, layers: tuple[tuple[str, ...], ...]) -> str:
    implied = "" if e.dst == e.named else f" (runs its __init__ by importing {e.named})"
    names = [n or "<facade>" for n in (layers[layer_of(e.src, layers, package)][0],
                                        layers[layer_of(e.dst, layers, package)][0])]
    return f"{e.where(root, package)}: {e.src} imports {e.dst}{implied}: layer {names[0]} < {names[1]}"


# ---------------------------------------------------------------------------------------- the package


def test_every_module_is_in_a_layer() -> None:
    unplaced = []
    for module in module_names(ROOT, PACKAGE):
        try:
            layer_of(module, LAYERS)
        except KeyError as exc:
            unplaced.append(str(exc))
    assert not unplaced, "add these to LAYERS in tests/test_imports.py:\n" + "\n".join(unplaced)


def test_no_import_circles() -> None:
    found = cycles(without_allowed(import_graph(ROOT), ALLOWED))
    assert not found, "import circles:\n" + "\n".join(describe_circle(c, ROOT, PACKAGE) for c in found)


def test_no_upward_imports() -> None:
    found = upward(without_allowed(import_graph(ROOT), ALLOWED), LAYERS)
    assert not found, "imports up the layer order:\n" + "\n".join(
        describe_edge(e, ROOT, PACKAGE, LAYERS) for e in found)


def test_allowed_edges_still_exist() -> None:
    present = {(e.src, e.named) for e in import_graph(ROOT)}
    stale = [f"{src} -> {dst}" for src, dst in ALLOWED if (src, dst) not in present]
    assert not stale, ("these ALLOWED edges are gone; delete them from tests/test_imports.py: "
                       + ", ".join(stale))


def test_the_graph_sees_the_package() -> None:
    """The checks above are only as good as the graph: it must hold the imports a reader sees."""
    edges = {(e.src, e.dst) for e in import_graph(ROOT)}
    assert ("tinypipe.runtime.engine", "tinypipe.schedule.builder") in edges  # top level
    assert ("tinypipe.train.model_io", "tinypipe.models.skeleton") in edges  # inside a function
    assert ("tinypipe.cli.finetune", "tinypipe.lora") in edges  # a name from a package's __init__
    assert ("tinypipe.planner.search", "tinypipe.lora") in edges  # implied by tinypipe.lora.settings
    assert ("tinypipe.quant.sizing", "tinypipe.models.decompose") in edges  # quant builds on models


def test_models_never_import_quant() -> None:
    """The model layer is below the quantization layer: what it needs of quantized weights is
    handed in (``Decomposition(model, quant=HOOKS)``), never imported, not even inside a function."""
    assert layer_of("tinypipe.models.decompose", LAYERS) < layer_of("tinypipe.quant.hooks", LAYERS)
    found = [e for e in import_graph(ROOT) if e.src.startswith("tinypipe.models.")
             and e.named.startswith("tinypipe.quant") and e.dst == e.named]
    assert not found, "\n".join(describe_edge(e, ROOT, PACKAGE, LAYERS) for e in found)


def test_the_package_never_imports_the_benchmarks() -> None:
    """``bench/benchkit`` (workloads, bounds, RSS sampling) is outside the package: an installed
    tinypipe has no ``bench/``, so no module may import it, not even inside a function."""
    found = []
    for name, path in module_names(ROOT, PACKAGE).items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{module_path(name, ROOT, PACKAGE)}:{node.lineno}: {n}" for n in names
                      if n.split(".")[0] in ("benchkit", "bench")]
    assert not found, "the package imports benchmark code:\n" + "\n".join(found)


# ------------------------------------------------------------------------------- the checker itself


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_checker_finds_a_circle_closed_by_a_type_only_import(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high.b import B\n",
        "high/__init__.py": "",
        "high/b.py": "def f():\n    from ..low import a\n",
    })
    edges = import_graph(pkg, "pkg")
    found = cycles(edges)
    assert len(found) == 1
    assert {e.src for e in found[0][1]} >= {"pkg.low.a", "pkg.high.b"}
    text = describe_circle(found[0], pkg, "pkg")
    assert "pkg/low/a.py:3" in text and "pkg/high/b.py:2" in text
    layers = (("low",), ("high",), ("",))
    up = upward(edges, layers, "pkg")
    assert [(e.src, e.dst, e.line) for e in up] == [("pkg.low.a", "pkg.high.b", 3)]
    assert not cycles(without_allowed(edges, {("pkg.low.a", "pkg.high.b")}))


def test_checker_counts_package_inits_and_spares_own_package(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "__init__.py": "from pkg.top.api import run\n",  # the facade: not a dependency of anyone
        "base/__init__.py": "from pkg.base.x import X\n",
        "base/x.py": "from pkg.base import y\nX = 1\n",
        "base/y.py": "import pkg.base.x\n",
        "top/__init__.py": "",
        "top/api.py": "from pkg.base.x import X\nrun = X\n",
    })
    edges = {(e.src, e.dst) for e in import_graph(pkg, "pkg")}
    assert ("pkg.top.api", "pkg.base") in edges  # importing pkg.base.x runs pkg/base/__init__.py
    assert ("pkg.base.x", "pkg.base") not in edges  # already imported when pkg.base.x runs
    assert ("pkg.base.x", "pkg") not in edges and ("pkg", "pkg.top.api") in edges
    found = cycles(import_graph(pkg, "pkg"))
    assert [component for component, _ in found] == [["pkg.base.x", "pkg.base.y"]]


@pytest.mark.parametrize("module", ["tinypipe", "tinypipe.errors", "tinypipe.cli.plan"])
def test_layer_of_known_modules(module: str) -> None:
    assert 0 <= layer_of(module, LAYERS) < len(LAYERS)

