"""docs/configuration.md is generated from Config's documented fields and checked against them: an
undocumented field, a field the page lacks or one it still lists after it left Config fails here,
by name (issue #33: each field documented where it is declared, in sections)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

import tinypipe
from tinypipe.config_reference import differences, main, markdown_text, reference_markdown
from tinypipe.documented import Section, UndocumentedError, documented_fields, sections, setting

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

FIRST = Section("First", "What the first fields decide.")
SECOND = Section("Second")


@dataclass
class Throwaway:
    """A class the tests may break (Config stays as it is)."""

    size: int = setting(1, FIRST, "How big, in ``units``.")
    name: str = setting("a", SECOND, "What it is called.")


def test_the_page_is_configs() -> None:
    assert differences(PAGE.read_text()) == []
    assert main(["--check", str(PAGE)]) == 0


def test_every_config_field_is_documented_in_a_section() -> None:
    documented = documented_fields(tinypipe.Config)  # strict: raises naming any undocumented field
    assert [d.name for d in documented] == [f.name for f in dataclasses.fields(tinypipe.Config)]
    titles = [s.title for s, _ in sections(tinypipe.Config)]
    assert len(titles) == len(set(titles)) >= 8
    page = PAGE.read_text()
    for d in documented:
        assert f"### `{d.name}`" in page
    assert "`--micro-batch`" in page and "`--no-assist` sets it to `False`" in page  # the flags


def test_an_undocumented_field_is_named() -> None:
    """A field declared the plain way (``b: int = 2``) has no documentation: the generator refuses,
    naming it, and so does the check."""

    @dataclass
    class Undocumented(Throwaway):
        extra_knob: int = 2

    with pytest.raises(UndocumentedError, match=r"Undocumented\.extra_knob: undocumented"):
        reference_markdown(Undocumented)
    assert differences(reference_markdown(Throwaway, header="# t\n"), Undocumented) == [
        "Undocumented.extra_knob: undocumented (declare it with setting(default, SECTION, doc))"]
    blank = dataclasses.make_dataclass("Blank", [("knob", int, setting(0, FIRST, "  "))])
    with pytest.raises(UndocumentedError, match=r"Blank\.knob: undocumented"):
        documented_fields(blank)


def test_a_section_declared_in_pieces_is_named() -> None:
    @dataclass
    class Scattered(Throwaway):
        late: int = setting(0, FIRST, "Declared after the Second section began.")

    with pytest.raises(UndocumentedError, match=r"Scattered\.late: section 'First' declared apart"):
        documented_fields(Scattered)


def test_drift_is_named() -> None:
    """A field missing from the page, a stale one, or changed text: each is a difference."""
    page = PAGE.read_text()
    missing = page.replace("### `lr`", "### `learning_rate`", 1)
    assert differences(missing) == ["Config.lr: not in the reference",
                                     "Config.learning_rate: in the reference, not a field"]
    edited = page.replace("AdamW's denominator term", "AdamW's epsilon", 1)
    assert differences(edited) == [
        "the reference's text differs from the fields' documentation (regenerate it)"]


def test_the_rendering() -> None:
    text = reference_markdown(Throwaway, {"size": ["`--size`"]}, header="# t\n")
    assert "## Sections\n\n- [First](#first): `size`\n- [Second](#second): `name`" in text
    assert "### `size`\n\n`int` · default `1` · finetune `--size`\n\nHow big, in `units`." in text
    assert "## First\n\nWhat the first fields decide.\n" in text
    assert markdown_text("see :mod:`tinypipe.runtime.rng`, :class:`~tinypipe.errors.ConfigError` and "
                         "docs/lora.md") == "see `tinypipe.runtime.rng`, `ConfigError` and [lora.md](lora.md)"


def test_help_lists_the_fields() -> None:
    """``help(tinypipe.Config)`` carries the same documentation, appended from the declarations."""
    doc = tinypipe.Config.__doc__ or ""
    assert "The plan: packing, micro-batches, placement:" in doc
    assert "* ``turn_packs`` (default ``None``) -- The last N packs run" in doc
