"""``kvgate certs``: bad arguments are usage errors (exit 2) that touch no file; a CA refused for its
lifetime leaves the one in place whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from certs.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--name", "bogus"], "bad service name 'bogus'"),
        (["--name", "extproc", "--san", "FOO:x"], "bad SAN 'FOO:x'"),
        (["--name", "extproc", "--days", "999"], "lifetime must be 1-398 days, got 999"),
    ],
)
def test_bad_issue_arguments_are_usage_errors(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["init", "--dir", str(tmp_path)]) == 0
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as exited:
        main(["issue", "--dir", str(tmp_path), *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_init_with_a_bad_lifetime_keeps_the_ca_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It wrote a new ca.key, then refused the lifetime: ca.pem no longer matched its key."""
    assert main(["init", "--dir", str(tmp_path)]) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(SystemExit) as exited:
        main(["init", "--dir", str(tmp_path), "--force", "--days", "0"])
    assert exited.value.code == 2
    assert "lifetime must be 1-398 days, got 0" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert main(["issue", "--dir", str(tmp_path), "--name", "extproc"]) == 0
