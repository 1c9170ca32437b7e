"""No command writes over its own input, and one output has one writer: `run` (and its kill -9),
`cascade`, `choose` and `split` refuse before they delete anything, naming both paths."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tokenmill.cli import main
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.errors import JobError
from tokenmill.jobs.input.request import DocumentOptions
from tokenmill.jobs.journal.guard import OutputLock
from tokenmill.jobs.journal.index import INDEX_HEADER, INDEX_RECORD
from tokenmill.jobs.runner import run_job

from .conftest import EchoBackend, assert_exactly_once, batch_line, read_jsonl, write_jsonl
from .stub_server import StubServer

ROWS = [batch_line(f"r{i}", f"row {i}") for i in range(6)]


def _job(input_path: Path, output: Path, **kw: object) -> JobConfig:
    return JobConfig(input=input_path, output=output, progress=False, options=DocumentOptions(max_tokens=4),
                     **kw)  # type: ignore[arg-type]


# Where the input is, relative to tmp_path, and the -o / --errors that would write over it.
OVERLAPS = [
    ("in.jsonl", {"output": "in.jsonl"}),
    ("in.jsonl", {"output": "res.jsonl", "errors": "in.jsonl"}),
    ("out/results.jsonl", {"output": "out"}),
    ("out/errors.jsonl", {"output": "out"}),
    ("out/summary.json", {"output": "out"}),
    ("out/job.json", {"output": "out"}),
    ("res.index", {"output": "res.jsonl"}),
    ("out/results/part-00001.jsonl", {"output": "out"}),
    ("link.jsonl", {"output": "in.jsonl"}),  # the output is the input by another name
]


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize(("where", "flags"), OVERLAPS)
def test_run_never_writes_over_its_input(tmp_path: Path, where: str, flags: dict[str, str], overwrite: bool) -> None:
    path = tmp_path / where
    path.parent.mkdir(parents=True, exist_ok=True)
    if where == "link.jsonl":
        write_jsonl(tmp_path / "in.jsonl", ROWS)
        path.symlink_to(tmp_path / "in.jsonl")
    else:
        write_jsonl(path, ROWS)
    before = path.read_bytes()
    named = {k: tmp_path / v for k, v in flags.items()}
    echo = EchoBackend()
    with pytest.raises(JobError, match="destroy its own input") as refused:
        run_job(_job(path, overwrite=overwrite, **named), echo)  # type: ignore[arg-type]
    assert str(path) in str(refused.value)
    assert path.read_bytes() == before and not echo.served


def test_the_cli_refuses_an_overwrite_of_the_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", ROWS)
    before = path.read_bytes()
    assert main(["run", str(path), "-o", str(path), "--overwrite", "--no-progress",
                 "--endpoint", "http://127.0.0.1:9", "--model", "m"]) == 2
    err = capsys.readouterr().err
    assert "destroy its own input" in err and str(path) in err
    assert path.read_bytes() == before


def test_an_input_beside_the_outputs_is_fine(tmp_path: Path) -> None:
    out = tmp_path / "out"
    path = write_jsonl(out.mkdir() or out / "in.jsonl", ROWS)
    assert run_job(_job(path, out), EchoBackend()).status == "done"
    assert run_job(_job(path, out, overwrite=True), EchoBackend()).status == "done"
    assert_exactly_once(out, len(ROWS))
    assert path.exists()


def _wait_for_holder(lock: Path, timeout: float = 60) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lock.exists() and lock.read_text().strip():
            return json.loads(lock.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{lock} was never taken")


def test_a_second_run_on_an_output_is_refused_and_a_kill_releases_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_proxies: None,
) -> None:
    rows = [batch_line(f"r{i}", f"row {i}") for i in range(40)]
    path, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out"
    with StubServer(delay=0.2) as stub:
        flags = ["--endpoint", stub.url, "--model", "m", "--concurrency", "2", "--no-progress"]
        first = subprocess.Popen([sys.executable, "-m", "tokenmill", "run", str(path), "-o", str(out), *flags],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            holder = _wait_for_holder(out / "results.lock")
            assert holder["pid"] == first.pid
            for second in (["-o", str(out)], ["-o", str(out), "--overwrite"], ["-o", str(out / "results.jsonl")]):
                assert main(["run", str(path), *second, *flags]) == 2
                err = capsys.readouterr().err
                assert f"pid {first.pid}" in err and "being written by another tokenmill" in err
            assert first.poll() is None, "the first run was disturbed"
            os.kill(first.pid, signal.SIGKILL)
            first.wait(timeout=30)
        finally:
            first.kill()
        assert main(["run", str(path), "-o", str(out), *flags]) == 0  # the kernel released the lock
    assert_exactly_once(out, len(rows))
    assert (out / "results.lock").exists()  # left for the next run, never deleted


def test_the_lock_names_its_holder_and_lets_go(tmp_path: Path) -> None:
    lock = tmp_path / "out" / "results.lock"
    with (OutputLock(lock, tmp_path / "out"), pytest.raises(JobError, match=f"pid {os.getpid()} on .*: "),
          OutputLock(lock, tmp_path / "out")):
        pass
    with OutputLock(lock, tmp_path / "out"):  # released on exit
        pass


def test_an_index_two_writers_interleaved_is_rebuilt_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What two unlocked runs left (an older tokenmill): rows twice, index records out of row order."""
    path, out = write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out"
    assert run_job(_job(path, out), EchoBackend()).status == "done"
    results, index = out / "results.jsonl", out / "results.index"
    lines = results.read_bytes().splitlines(keepends=True)
    records = np.fromfile(index, INDEX_RECORD, offset=INDEX_HEADER)
    results.write_bytes(b"".join(lines[:3] + lines[:3] + lines[3:]))  # the second writer redid rows 0-2
    ends = np.cumsum([len(line) for line in lines[:3] + lines[:3] + lines[3:]])
    doubled = np.concatenate([records[:3], records[:3], records[3:]])
    doubled["end"] = ends[[0, 3, 1, 4, 2, 5, 6, 7, 8]]  # the two writers' records interleaved
    index.write_bytes(index.read_bytes()[:INDEX_HEADER] + doubled.tobytes())
    echo = EchoBackend()
    assert run_job(_job(path, out), echo).status == "done"
    assert not echo.served
    err = capsys.readouterr().err
    assert "did not match" in err and "removed 3 row(s)" in err
    assert_exactly_once(out, len(ROWS))
    assert [r["custom_id"] for r in read_jsonl(results)] == [f"r{i}" for i in range(len(ROWS))]
