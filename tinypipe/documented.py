"""Dataclass fields documented where they are declared, in sections.

``name: type = setting(default, SECTION, "what it does, what it costs, when to change it")`` is a
``dataclasses.field`` whose metadata holds its :class:`Section` and its documentation (Mosaic's
``hp.optional(doc, default=...)`` and DeepSpeed's docstring under each pydantic field do the same
job; this needs no dependency and the text can be read back at run time). :func:`documented_fields`
reads every field back in declaration order and refuses (:class:`UndocumentedError`, naming them)
a field declared without documentation or section, and a section whose fields are declared apart.

:class:`tinypipe.Config` declares its fields this way; ``docs/configuration.md`` is rendered from
them (:mod:`tinypipe.config_reference`) and ``help(tinypipe.Config)`` lists them (:func:`fields_text`).
Documentation is written as the package's docstrings are: paragraphs separated by blank lines,
``literals`` and ``:mod:`roles``` allowed.
"""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import MISSING, dataclass
from typing import Any

SECTION_KEY = "section"
DOC_KEY = "doc"


@dataclass(frozen=True)
class Section:
    """A group of settings: its title and a paragraph on what the group decides."""

    title: str
    intro: str = ""


class UndocumentedError(ValueError):
    """A field without documentation or section, or a section declared in pieces (one line per problem)."""


def setting(default: Any, section: Section, doc: str, *, default_factory: Any = MISSING) -> Any:
    """A dataclass field with ``default`` (or ``default_factory``; pass ``MISSING`` as ``default``)
    documented by ``doc`` in ``section``."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={SECTION_KEY: section, DOC_KEY: doc})


@dataclass(frozen=True)
class DocumentedField:
    """One field as the references show it."""

    name: str
    type: str  # the annotation as written
    default: str  # repr of the default (of the factory's value), "" for a required field
    section: Section
    doc: str  # paragraphs separated by one blank line, each on one line


def paragraphs(text: str) -> str:
    """``text`` dedented, each paragraph joined onto one line, paragraphs separated by a blank line."""
    blocks = textwrap.dedent(text).strip().split("\n\n")
    return "\n\n".join(" ".join(b.split()) for b in blocks if b.strip())


def _default(f: dataclasses.Field) -> str:
    if f.default is not MISSING:
        return repr(f.default)
    if f.default_factory is not MISSING:
        return repr(f.default_factory())
    return ""


def documented_fields(cls: type, strict: bool = True) -> list[DocumentedField]:
    """``cls``'s fields with their sections and documentation, in declaration order. ``strict``:
    raise :class:`UndocumentedError` naming every field without documentation or section and every
    section whose fields are not declared together; else leave those fields out."""
    out: list[DocumentedField] = []
    problems: list[str] = []
    for f in dataclasses.fields(cls):
        section, doc = f.metadata.get(SECTION_KEY), f.metadata.get(DOC_KEY)
        if not isinstance(section, Section) or not isinstance(doc, str) or not doc.strip():
            problems.append(f"{cls.__name__}.{f.name}: undocumented (declare it with "
                            "setting(default, SECTION, doc))")
            continue
        type_text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", repr(f.type))
        out.append(DocumentedField(f.name, type_text, _default(f), section, paragraphs(doc)))
    seen: list[Section] = []
    for d in out:
        if seen and d.section == seen[-1]:
            continue
        if d.section in seen:
            problems.append(f"{cls.__name__}.{d.name}: section {d.section.title!r} declared apart from "
                            f"its other fields (after {seen[-1].title!r}); keep a section's fields together")
        seen.append(d.section)
    if problems and strict:
        raise UndocumentedError("; ".join(problems))
    return out


def sections(cls: type) -> list[tuple[Section, list[DocumentedField]]]:
    """``cls``'s documented fields grouped by section, in declaration order (strict)."""
    out: list[tuple[Section, list[DocumentedField]]] = []
    for d in documented_fields(cls):
        if not out or out[-1][0] != d.section:
            out.append((d.section, []))
        out[-1][1].append(d)
    return out


def fields_text(cls: type, indent: str = "    ") -> str:
    """The documented fields as plain text to append to ``cls.__doc__`` (``help()``), section by
    section, each line indented by ``indent`` (a class docstring's own indentation). Lenient: a
    field without documentation is left out here (the reference's test names it)."""
    lines: list[str] = []
    last: Section | None = None
    for d in documented_fields(cls, strict=False):
        if d.section != last:
            lines += ["", f"{d.section.title}:", ""]
            if d.section.intro.strip():
                lines += textwrap.wrap(paragraphs(d.section.intro), 98) + [""]
            last = d.section
        default = f" (default ``{d.default}``)" if d.default else ""
        first, *rest = d.doc.split("\n\n")
        lines += textwrap.wrap(f"* ``{d.name}``{default} -- {first}", 96, subsequent_indent="  ")
        for para in rest:
            lines += [""] + textwrap.wrap(para, 96, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(indent + line if line else "" for line in lines)
