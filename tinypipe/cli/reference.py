"""The command-line reference, ``docs/cli_reference.md``, generated from the parser itself.

Why generated: a hand-written flag list drifts from the code (a new flag nobody documents, a
removed one still described). ``python -m tinypipe.cli.reference --write docs/cli_reference.md``
rewrites the page; ``--check`` exits 1 and names the flags when the page and the parser differ
(tests/test_cli_reference.py runs it). Building the parser imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

HEADER = """# Command-line reference

Generated from the parser by `python -m tinypipe.cli.reference --write docs/cli_reference.md`; do
not edit by hand (tests/test_cli_reference.py fails when this page and the flags differ). What the
flags mean in practice -- data formats, packing, checkpoints, Hugging Face Trainer semantics -- is
in [cli.md](cli.md). Every `finetune` flag may also be set in `--config FILE` (TOML or YAML, the flag
name with underscores as the key); flags override the file.
"""


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' parsers, in the order they were added."""
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _documented(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def flags(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """Command -> every option string it accepts (help aside)."""
    return {name: {s for a in _documented(sub) for s in a.option_strings}
            for name, sub in commands(parser).items()}


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return str(action.metavar or action.dest.upper())


def _default(action: argparse.Action) -> str:
    d = action.default
    if d is None or d is argparse.SUPPRESS or action.nargs == 0:
        return ""
    return f"`{d}`"


def reference_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole page for ``parser`` (default: the ``tinypipe`` command's)."""
    if parser is None:
        from tinypipe.cli import build_parser

        parser = build_parser()
    out = [HEADER]
    for name, sub in commands(parser).items():
        out.append(f"## `tinypipe {name}`\n")
        if sub.description:
            out.append(_cell(sub.description) + "\n")
        out.append("| flag | value | default | what it does |")
        out.append("|---|---|---|---|")
        for action in _documented(sub):
            help_text = (action.help or "").replace("%%", "%")
            names = ", ".join(action.option_strings)
            out.append(f"| `{names}` | {_cell(_value(action))} | {_default(action)} | {_cell(help_text)} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def differences(page: str, parser: argparse.ArgumentParser | None = None) -> list[str]:
    """What differs between ``page`` and the parser: flags missing from the page or no longer in
    the parser (by name), else that the generated text changed."""
    if parser is None:
        from tinypipe.cli import build_parser

        parser = build_parser()
    out = []
    for name, options in flags(parser).items():
        section = page.split(f"## `tinypipe {name}`", 1)
        body = section[1].split("\n## ", 1)[0] if len(section) == 2 else ""
        listed = {s.strip() for line in body.splitlines() if line.startswith("| `")
                  for s in line.split("`")[1].split(",")}
        out += [f"tinypipe {name} {flag}: not in the reference" for flag in sorted(options - listed)]
        out += [f"tinypipe {name} {flag}: in the reference, not a flag" for flag in sorted(listed - options)]
    if not out and page != reference_markdown(parser):
        out.append("the reference's text differs from the parser's help (regenerate it)")
    return out


def write_or_check(argv: Sequence[str] | None, *, prog: str, doc: str | None, source: str,
                   render: Callable[[], str], drift: Callable[[str], list[str]],
                   refusals: tuple[type[Exception], ...] = ()) -> int:
    """The command line of a generated reference page: ``--write FILE`` renders it (an error of a
    ``refusals`` type: its "; "-separated problems, one per line, exit 1), ``--check FILE`` prints
    what ``drift`` finds between FILE and ``source`` and exits 1 if anything."""
    ap = argparse.ArgumentParser(prog=prog, description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", metavar="FILE", help="write the reference to FILE")
    group.add_argument("--check", metavar="FILE", help=f"exit 1 when FILE differs from {source}")
    a = ap.parse_args(argv)
    if a.write:
        try:
            text = render()
        except refusals as exc:
            print("\n".join(str(exc).split("; ")), file=sys.stderr)
            return 1
        Path(a.write).write_text(text)
        return 0
    problems = drift(Path(a.check).read_text())
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    return write_or_check(argv, prog="python -m tinypipe.cli.reference", doc=__doc__, source="the parser",
                          render=reference_markdown, drift=differences)


if __name__ == "__main__":
    sys.exit(main())
