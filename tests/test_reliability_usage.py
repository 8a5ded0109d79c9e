"""Issue #34, item 6: a usage error is one line (not argparse's 22-line usage) with exit 2, and a
negative number is read as an option's value (``--lr -1e-3`` reaches the settings check, which says
in one line what is wrong with it)."""

from __future__ import annotations

import pytest

from test_cli import assert_one_line_error, run_cli


@pytest.mark.parametrize("argv, needle", [
    ((), "required: COMMAND"),
    (("finetune", "--bogus"), "unrecognized arguments: --bogus"),
    (("finetune", "--steps", "many"), "expected an integer"),
    (("finetune", "--schedule", "bogus"), "invalid choice"),
    (("plan", "--nope"), "--model"),
])
def test_usage_errors_are_one_line(capsys, argv, needle) -> None:  # type: ignore[no-untyped-def]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert_one_line_error(err, needle, "--help")
    assert len(err.strip().splitlines()) == 1, err


def test_a_negative_value_is_a_value(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    code, _, err = run_cli(capsys, "finetune", "--model", tmp_path, "--data", tmp_path, "--output",
                           tmp_path / "o", "--lr", "-1e-3")
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert_one_line_error(err, "lr must be >= 0, got -0.001")
