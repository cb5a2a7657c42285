"""``kvgate COMMAND --help``: every command prints its usage on stdout and exits 0 (an operator's first
question must not read as a failure)."""

from __future__ import annotations

import pytest

from kvgate.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_answers_help_with_exit_0(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = main([command, "--help"])
    except SystemExit as exit_:  # argparse's --help
        rc = exit_.code if isinstance(exit_.code, int) else 0
    out = capsys.readouterr().out
    assert rc == 0
    assert "usage" in out.lower()


def test_model_without_its_subcommand_is_bad_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model"]) == 2
    assert "usage: kvgate model export" in capsys.readouterr().err
