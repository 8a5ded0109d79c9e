"""docs/cli_reference.md is generated from the parser and checked against it: a flag the page does
not list (or a listed flag that is gone) fails here, by name."""

from __future__ import annotations

from pathlib import Path

from tinypipe.cli import build_parser
from tinypipe.cli.reference import commands, differences, flags, main, reference_markdown

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli_reference.md"


def test_the_reference_is_the_parsers() -> None:
    assert differences(PAGE.read_text()) == []
    assert main(["--check", str(PAGE)]) == 0


def test_every_command_and_flag_is_on_the_page() -> None:
    page = PAGE.read_text()
    parser = build_parser()
    assert set(commands(parser)) == {"demo", "finetune", "plan", "profile"}
    for name, options in flags(parser).items():
        assert f"## `tinypipe {name}`" in page
        assert all(f"`{o}`" in page or f"`{o}," in page or f", {o}`" in page for o in options), name


def test_an_undocumented_flag_and_a_stale_one_are_named() -> None:
    """A flag added to the parser but not to the page fails, naming it; so does a flag the page
    still lists after it left the parser."""
    parser = build_parser()
    commands(parser)["finetune"].add_argument("--brand-new-flag", type=int, help="nobody documented me")
    problems = differences(PAGE.read_text(), parser)
    assert problems == ["tinypipe finetune --brand-new-flag: not in the reference"]
    stale = PAGE.read_text().replace("| `--no-progress` |", "| `--gone-flag` |", 1)
    problems = differences(stale)
    assert "tinypipe demo --no-progress: not in the reference" in problems
    assert "tinypipe demo --gone-flag: in the reference, not a flag" in problems
    # help text changed but no flag: still a difference (regenerate)
    edited = reference_markdown().replace("no progress bar", "no bar", 1)
    assert differences(edited) == ["the reference's text differs from the parser's help (regenerate it)"]
