"""The bundled demo corpus: English prose about Python, shipped as package data.

``tinypipe/data/demo_corpus.txt`` holds a selection of the documentation topics that CPython
ships offline in ``pydoc_data.topics`` (the text ``help("for")`` shows), so the demo needs no
download. It was generated once by :func:`build_demo_corpus` (run ``python -m
tinypipe.train.corpus`` to regenerate it) and is committed, so every install trains on the same
bytes whatever Python version runs it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from tinypipe.errors import TinypipeError

__all__ = ["DEMO_CORPUS", "build_demo_corpus", "demo_corpus_path"]

DEMO_CORPUS = "demo_corpus.txt"
TARGET_CHARS = 200_000
# Reference tables and command listings rather than prose: left out so the text reads as English.
_SKIPPED_TOPICS = frozenset({"debugger", "operator-summary", "formatstrings"})


def demo_corpus_path() -> Path:
    """Path of the bundled demo corpus (plain UTF-8 text, ~200 KB)."""
    path = Path(str(resources.files("tinypipe").joinpath("data", DEMO_CORPUS)))
    if not path.is_file():
        raise TinypipeError(f"the bundled demo corpus is missing ({path}); reinstall tinypipe")
    return path


def build_demo_corpus(target_chars: int = TARGET_CHARS) -> str:
    """Concatenate ``pydoc_data.topics`` entries (alphabetical order) up to ``target_chars``.

    Topics that would overshoot the target are skipped, so smaller ones later in the order can
    still fill it; the result is deterministic for a given Python version.
    """
    from pydoc_data.topics import topics

    parts: list[str] = []
    size = 0
    for key in sorted(topics):
        if key in _SKIPPED_TOPICS:
            continue
        text = topics[key].strip() + "\n\n"
        if size + len(text) > target_chars:
            continue
        parts.append(text)
        size += len(text)
    return "".join(parts).rstrip("\n") + "\n"


def _main() -> None:  # pragma: no cover - maintenance helper
    out = Path(__file__).resolve().parent.parent / "data" / DEMO_CORPUS
    out.parent.mkdir(parents=True, exist_ok=True)
    text = build_demo_corpus()
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out} ({len(text.encode('utf-8'))} bytes)")


if __name__ == "__main__":  # pragma: no cover
    _main()
