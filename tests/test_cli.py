"""The `tokenmill` command itself (each subcommand is tested beside its package)."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from tokenmill.cli import main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"tokenmill {version('tokenmill')}"  # pyproject.toml's
