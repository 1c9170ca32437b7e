"""Every path a command takes is checked before any work: a clear message naming the flag, exit 2,
and nothing created; a disk that fills mid-job stops the job cleanly, and a re-run resumes."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenmill.cli import main

from .conftest import batch_line, read_jsonl, write_jsonl
from .stub_server import StubServer

NO_SERVER = ["--endpoint", "http://127.0.0.1:9/v1", "--retry-for", "1", "--no-progress"]


@pytest.fixture
def place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with a good input, a regular file and a folder, as the working directory."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "in.jsonl", [batch_line("a", "hello")])
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "adir").mkdir()
    return tmp_path


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["adir", "-o", "out"], "input adir: is a folder, not a file"),
    (["missing.jsonl", "-o", "out"], "input missing.jsonl: no such file or folder"),
    (["afile/in.jsonl", "-o", "out"], "input afile/in.jsonl: no such file (afile is a file, not a folder)"),
    (["in.jsonl", "-o", "afile/out"], "-o afile/out: afile is a file, not a folder"),  # was NotADirectoryError
    (["in.jsonl", "-o", "afile"], "-o afile: is a file, not a folder"),
    (["in.jsonl", "-o", "afile/res.jsonl"], "-o afile/res.jsonl: afile is a file, not a folder"),
    (["in.jsonl", "-o", "out", "--errors", "adir"], "--errors adir: is a folder, not a file"),
    (["in.jsonl", "-o", "out", "--errors", "afile/e.jsonl"], "--errors afile/e.jsonl: afile is a file"),
    (["in.jsonl", "-o", "out", "--model", "no/such/model.gguf"], "--model no/such/model.gguf: no such file"),
])
def test_run_refuses_a_path_it_cannot_use_before_any_work(
    place: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    model_flags = [] if "--model" in argv else NO_SERVER
    code, err = run_cli(["run", *argv, *model_flags], capsys)
    assert code == 2
    assert err.startswith(f"tokenmill run: {message}"), err
    assert "Traceback" not in err
    assert not (place / "out").exists()  # nothing claimed: a fixed re-run is not "a different job"


@pytest.mark.parametrize(("argv", "message"), [
    (["choose", "in.jsonl", "--expected", "adir", "-o", "co"], "--expected adir: is a folder, not a file"),
    (["choose", "in.jsonl", "--expected", "in.jsonl", "-o", "afile/co"], "-o afile/co: afile is a file, not a folder"),
    (["choose", "adir", "--expected", "in.jsonl", "-o", "co"], "the job adir: is a folder, not a file"),
    (["choose", "in.jsonl", "--expected", "in.jsonl", "-o", "co", "--scorer", "json", "--schema", "adir"],
     "--schema adir: is a folder, not a file"),
])
def test_choose_refuses_a_path_it_cannot_use(
    place: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, err = run_cli([*argv, "--candidate", "a=--max-tokens 2", "--min-quality", "0.5"], capsys)
    assert (code, err.strip()) == (2, f"tokenmill choose: error: {message}")


def test_cascade_split_and_plan_refuse_a_path_they_cannot_use(place: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiers = ["--tier", "a=--max-tokens 2", "--tier", "b=--max-tokens 3", "--accept", "parses"]
    assert run_cli(["cascade", "adir", "-o", "cc", *tiers], capsys) == (
        2, "tokenmill cascade: error: input adir: is a folder, not a file\n")
    assert run_cli(["split", "in.jsonl", "-o", "afile/parts"], capsys) == (  # was NotADirectoryError
        2, "tokenmill split: -o afile/parts: afile is a file, not a folder\n")
    assert run_cli(["plan", "--model", "qwen2.5-7b", "--hardware", "h100-sxm", "--json", "afile/plan.json"],
                   capsys) == (2, "tokenmill plan: error: --json afile/plan.json: afile is a file, not a folder\n")
    assert run_cli(["plan", "--study", "--study-file", "adir"], capsys) == (  # plan's own wording
        2, "tokenmill plan: error: study: cannot read adir: Is a directory\n")
    assert not any((place / name).exists() for name in ("cc", "parts"))


# ---- read-only folders, unreadable files, a full disk: real ones ---------------------------------------
def _mount_tmpfs(where: Path, options: str) -> bool:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    return done.returncode == 0


@contextlib.contextmanager
def _unmounted_after(where: Path) -> Iterator[Path]:
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def read_only_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder this process cannot write in: a read-only tmpfs as root (who ignores permission
    bits), else one without write permission."""
    where = tmp_path / "ro"
    if os.geteuid() != 0:
        where.mkdir()
        where.chmod(0o555)
        yield where
        where.chmod(0o755)
        return
    if not _mount_tmpfs(where, "ro,size=64k"):
        pytest.skip("running as root and cannot mount a read-only tmpfs")
    with _unmounted_after(where):
        yield where


def test_an_output_in_a_read_only_folder_is_refused(
    place: Path, read_only_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = ((["-o", f"{read_only_folder}/out"], "-o"),
             (["-o", "out", "--errors", f"{read_only_folder}/e.jsonl"], "--errors"))
    for argv, flag in cases:
        code, err = run_cli(["run", "in.jsonl", *argv, *NO_SERVER], capsys)
        assert code == 2
        assert err.startswith(f"tokenmill run: {flag} {read_only_folder}/")
        assert f"cannot write in {read_only_folder} (" in err  # the system's reason: read-only, permission denied
    assert not (place / "out").exists()


def test_an_unreadable_input_is_refused(place: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads any file: an unreadable input needs a non-root user")
    (place / "in.jsonl").chmod(0)
    code, err = run_cli(["run", "in.jsonl", "-o", "out", *NO_SERVER], capsys)
    assert (code, err) == (2, "tokenmill run: input in.jsonl: cannot be read (permission denied)\n")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (root only): a disk that fills."""
    if os.geteuid() != 0 or not _mount_tmpfs(tmp_path / "disk", "size=64k"):
        pytest.skip("a full disk needs a small tmpfs, which needs root and mount")
    with _unmounted_after(tmp_path / "disk") as where:
        yield where


def test_a_disk_that_fills_mid_job_stops_it_cleanly_and_a_rerun_resumes(
    place: Path, small_disk: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [batch_line(f"r-{i}", f"document {i} " + "x" * 200) for i in range(300)]  # ~300 × 600 B of results
    write_jsonl(place / "in.jsonl", rows)
    out = small_disk / "out"
    with StubServer(max_requests=1000) as stub:
        argv = ["run", "in.jsonl", "-o", str(out), "--endpoint", stub.url, "--no-progress", "--concurrency", "4"]
        code, err = run_cli(argv, capsys)
        assert code == 3, err  # started, could not go on: re-run resumes
        assert "tokenmill run: stopped: cannot write" in err and "no space left on device" in err
        assert "re-run the same command to resume" in err and "Traceback" not in err
        subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
        code, err = run_cli(argv, capsys)
        assert code == 0, err
    results = read_jsonl(out / "results.jsonl")
    assert sorted(r["custom_id"] for r in results) == sorted(f"r-{i}" for i in range(300))  # each once
