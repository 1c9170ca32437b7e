"""One server per --state-dir: a second `tokenmill serve` on it is refused before it loads a model,
naming the holder; the lock goes with the process that held it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tokenmill.cli import main
from tokenmill.serve.state import LOCK_NAME, hold_state_dir


def test_a_second_server_on_a_state_dir_is_refused_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state_dir = tmp_path / "state"
    serve = ["serve", "--state-dir", str(state_dir), "--model", str(tmp_path / "no-such-model.gguf")]
    with hold_state_dir(state_dir):  # as a running server holds it
        assert main(serve) == 2
    err = capsys.readouterr().err
    assert f"{state_dir} is being written by another tokenmill (pid {os.getpid()} on " in err
    assert f"lock {state_dir / LOCK_NAME}" in err and "choose another --state-dir" in err
    assert main(serve) == 2  # free again: now it gets as far as the model, which is not there
    err = capsys.readouterr().err
    assert "no-such-model" in err and "another tokenmill" not in err
