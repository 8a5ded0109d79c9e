"""The configuration reference, ``docs/configuration.md``, generated from :class:`tinypipe.Config`.

Why generated: a hand-written list of settings drifts from the code (a new field nobody documents,
a removed one still described, a default changed in one place). Each field of ``Config`` is
documented where it is declared (:func:`tinypipe.documented.setting`: its section and its text);
this module renders those declarations, with the ``tinypipe finetune`` flag that sets each field
(read off the option table, :mod:`tinypipe.cli.options`).

``python -m tinypipe.config_reference --write docs/configuration.md`` rewrites the page;
``--check docs/configuration.md`` exits 1 and names what differs -- a field declared without
documentation, a field the page lacks or lists after it left ``Config``, else that the text changed
(tests/test_config_reference.py runs it). Imports neither torch nor transformers.
"""

from __future__ import annotations

import re
import sys
import textwrap
import typing
from typing import Sequence

from tinypipe.documented import DocumentedField, UndocumentedError, documented_fields, paragraphs, sections

HEADER = """# Configuration reference

Generated from the fields of `tinypipe.Config` -- each documented where it is declared, in
`tinypipe/config.py` -- by `python -m tinypipe.config_reference --write docs/configuration.md`; do
not edit by hand (tests/test_config_reference.py fails when a field is undocumented or this page and
the code differ).

`tinypipe.Config(...)` takes these fields as keywords (`devices` may also come first) and checks
every value when it is made (one line, `ConfigError`); `help(tinypipe.Config)` shows the same text.
`tinypipe finetune` sets the fields whose entry names a flag (in `--config FILE` too, the flag's name
with underscores); its other flags -- data, schedule, checkpoints, evaluation, LoRA -- are the
command's own ([cli_reference.md](cli_reference.md)). LoRA and QLoRA adapters are described by
`tinypipe.lora.LoraSettings`, not by `Config` ([lora.md](lora.md)).
"""

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_DOC_LINK = re.compile(r"\bdocs/([A-Za-z0-9_]+\.md)\b")


def markdown_text(text: str) -> str:
    """Docstring markup as Markdown: ``literal`` -> `literal`, :role:`~a.b.c` -> `c` (`a.b.c`
    without the ~), docs/page.md -> a link to the page beside this one."""
    def role(m: re.Match) -> str:
        whole = m.group(0)
        target = m.group(1)
        return f"`{target.rsplit('.', 1)[-1] if '`~' in whole else target}`"

    text = _ROLE.sub(role, text).replace("``", "`")
    return _DOC_LINK.sub(r"[\1](\1)", text)


def _wrap(paragraph: str) -> str:
    return "\n".join(textwrap.wrap(paragraph, 100, break_long_words=False, break_on_hyphens=False))


def _choices(cls: type, d: DocumentedField) -> list[str]:
    """The values of the Literal aliases (``Precision``...) named in the field's annotation."""
    names = vars(sys.modules[cls.__module__])
    out: list[str] = []
    for word in re.findall(r"[A-Za-z_]\w*", d.type):
        alias = names.get(word)
        if typing.get_origin(alias) is typing.Literal:
            out += [str(a) for a in typing.get_args(alias) if str(a) not in out]
    return out


def finetune_flags() -> dict[str, list[str]]:
    """Config field -> the ``tinypipe finetune`` flags that set it (the option table's ``config``),
    as Markdown; a switch that sets its field to False says so."""
    import operator

    from tinypipe.cli.options import FINETUNE_OPTIONS

    out: dict[str, list[str]] = {}
    for o in FINETUNE_OPTIONS:
        if o.config is not None:
            inverted = " sets it to `False`" if o.to_config is operator.not_ else ""
            out.setdefault(o.config, []).append(f"`--{o.name}`{inverted}")
    return out


def _anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


def reference_markdown(cls: type | None = None, flags: dict[str, list[str]] | None = None,
                       header: str = HEADER) -> str:
    """The whole page for ``cls`` (default: :class:`tinypipe.Config`, with the finetune flags;
    ``flags``: field -> Markdown naming what sets it); :class:`UndocumentedError` naming every field
    declared without documentation or section."""
    if cls is None:
        from tinypipe.config import Config

        cls = Config
        flags = finetune_flags() if flags is None else flags
    flags = flags or {}
    grouped = sections(cls)
    out = [header, "## Sections\n"]
    for section, members in grouped:
        names = ", ".join(f"`{d.name}`" for d in members)
        out.append(f"- [{section.title}](#{_anchor(section.title)}): {names}")
    out.append("")
    for section, members in grouped:
        out.append(f"## {section.title}\n")
        if section.intro.strip():
            out += [_wrap(markdown_text(p)) + "\n" for p in paragraphs(section.intro).split("\n\n")]
        for d in members:
            out.append(f"### `{d.name}`\n")
            facts = [f"`{d.type}`"]
            choices = _choices(cls, d)
            if choices:
                facts.append("one of " + ", ".join(f"`{c}`" for c in choices))
            facts.append(f"default `{d.default}`" if d.default else "required")
            if d.name in flags:
                facts.append("finetune " + ", ".join(flags[d.name]))
            out.append(" · ".join(facts) + "\n")
            out += [_wrap(markdown_text(p)) + "\n" for p in d.doc.split("\n\n")]
    return "\n".join(out).rstrip() + "\n"


def differences(page: str, cls: type | None = None, flags: dict[str, list[str]] | None = None) -> list[str]:
    """What differs between ``page`` and ``cls`` (default: Config): fields declared without
    documentation, fields missing from the page or no longer fields (by name), else that the
    generated text changed."""
    if cls is None:
        from tinypipe.config import Config

        cls = Config
        flags = finetune_flags() if flags is None else flags
    name = cls.__name__
    try:
        fields = [d.name for d in documented_fields(cls)]
    except UndocumentedError as exc:
        return str(exc).split("; ")
    listed = re.findall(r"^### `([^`]+)`", page, flags=re.M)
    out = [f"{name}.{f}: not in the reference" for f in fields if f not in listed]
    out += [f"{name}.{f}: in the reference, not a field" for f in listed if f not in fields]
    if not out and page != reference_markdown(cls, flags):
        out.append("the reference's text differs from the fields' documentation (regenerate it)")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from tinypipe.cli.reference import write_or_check

    return write_or_check(argv, prog="python -m tinypipe.config_reference", doc=__doc__, source="Config",
                          render=reference_markdown, drift=differences, refusals=(UndocumentedError,))


if __name__ == "__main__":
    sys.exit(main())
