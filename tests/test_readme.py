"""The README's Python API example, run as it is written: a user copying it gets a job done."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_api_example(marker: str = "python-api") -> str:
    match = re.search(rf"<!-- {marker} -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert match, f"README.md lost its <!-- {marker} --> example"
    return match.group(1)


@pytest.mark.slow
def test_the_python_api_example_runs_a_job(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", python_api_example()], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    status, line, *answers = done.stdout.splitlines()
    assert status.startswith("done 2 ") and status.endswith("out/api/results.jsonl"), status
    completion = int(status.split()[2])
    assert 2 <= completion <= 8  # two rows of at most max_tokens=4 each
    assert [a.split()[0] for a in answers] == ["line-1", "line-2"]
    assert all(a.split()[1] in ("positive", "negative") for a in answers), answers  # held to the choice
    assert (tmp_path / "out/api/results.jsonl").read_text().count("\n") == 2
    assert re.fullmatch(r"[0-9.]+ out tok/s, \$[0-9.e-]+ per M", line), line


def test_the_embeddings_example_finds_the_nearest_documents(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", python_api_example("embeddings-api")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    shape, nearest = done.stdout.splitlines()
    assert shape == "(3, 384) float32"
    assert nearest == "['The kettle boils in a minute.', 'Water heats up really fast.']"
