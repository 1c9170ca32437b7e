"""Output files: torn-line repair, one write per row, where files go, whose job they are."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tokenmill.jobs.errors import JobError
from tokenmill.jobs.journal.files import repair_jsonl
from tokenmill.jobs.journal.identity import claim_outputs, job_record
from tokenmill.jobs.journal.paths import OutputPaths
from tokenmill.jobs.journal.rows import encode_row, error_row, is_final, result_row, usage_of
from tokenmill.jobs.journal.writers import JsonlAppender


def rows(n: int) -> list[dict]:
    return [result_row(f"r-{i}", {"usage": {}}) for i in range(n)]


def test_repair_cuts_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    good = b"".join(encode_row(r) for r in rows(3))
    path.write_bytes(good + b'{"id": "batch_req_x", "custom_id": "r-3", "resp')  # killed mid-write
    found, cut = repair_jsonl(path)
    assert [r["custom_id"] for r in found] == ["r-0", "r-1", "r-2"]
    assert cut == 47 and path.read_bytes() == good
    assert repair_jsonl(path) == (found, 0)  # idempotent


def test_repair_cuts_garbage_tail_even_with_newlines(tmp_path: Path) -> None:
    """After a power loss a file can end in zero bytes, newline or not."""
    path = tmp_path / "results.jsonl"
    good = b"".join(encode_row(r) for r in rows(2))
    path.write_bytes(good + b"\x00\x00\x00\n\x00\x00")
    found, cut = repair_jsonl(path)
    assert len(found) == 2 and cut == 6 and path.read_bytes() == good


def test_a_damaged_line_in_the_middle_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    lines = [encode_row(r) for r in rows(3)]
    path.write_bytes(lines[0] + b"oops\n" + lines[1])
    with pytest.raises(JobError, match="line 2 is damaged"):
        repair_jsonl(path)


def test_appender_writes_each_row_with_one_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes, syncs = [], []
    real_write, real_fsync = os.write, os.fsync
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(bytes(data)) or real_write(fd, data))
    monkeypatch.setattr(os, "fsync", lambda fd: syncs.append(fd) or real_fsync(fd))
    appender = JsonlAppender(tmp_path / "sub" / "out.jsonl", fsync_interval=0)
    big = result_row("big", {"text": "x" * 200_000})  # larger than any stdio buffer
    appender.write(big)
    appender.write(rows(1)[0])
    appender.close()
    assert len(writes) == 2 and all(w.endswith(b"\n") and w.count(b"\n") == 1 for w in writes)
    assert len(syncs) >= 2  # fsync_interval=0: every row
    assert [r["custom_id"] for r in map(json.loads, (tmp_path / "sub" / "out.jsonl").read_text().splitlines())] == [
        "big", "r-0"]


def test_output_layout_for_a_folder_and_for_a_file(tmp_path: Path) -> None:
    folder = OutputPaths.from_option(tmp_path / "out")
    assert folder == OutputPaths(tmp_path / "out/results.jsonl", tmp_path / "out/errors.jsonl",
                                 tmp_path / "out/summary.json", tmp_path / "out/job.json",
                                 tmp_path / "out/backend.json", tmp_path / "out/results.index")
    single = OutputPaths.from_option(tmp_path / "res.jsonl", errors=tmp_path / "bad.jsonl")
    assert single == OutputPaths(tmp_path / "res.jsonl", tmp_path / "bad.jsonl",
                                 tmp_path / "res.summary.json", tmp_path / "res.job.json",
                                 tmp_path / "res.backend.json", tmp_path / "res.index")


IDENTITY_A = {"size": 3, "ends_sha256": "a" * 64}


def test_outputs_belong_to_one_job(tmp_path: Path) -> None:
    paths = OutputPaths.from_option(tmp_path / "out")
    job = job_record(Path("in.jsonl"), IDENTITY_A, {"max_tokens": 8, "model": "m"})
    assert claim_outputs(paths, job, overwrite=False) is False
    paths.results.write_text(encode_row(rows(1)[0]).decode())
    assert claim_outputs(paths, job, overwrite=False) is True  # the same job: resume

    identity_b = {"size": 3, "ends_sha256": "b" * 64}
    other_input = job_record(Path("other.jsonl"), identity_b, {"max_tokens": 8, "model": "m"})
    with pytest.raises(JobError, match=r"input differs .*--overwrite"):
        claim_outputs(paths, other_input, overwrite=False)
    other_options = job_record(Path("in.jsonl"), IDENTITY_A, {"max_tokens": 9, "model": "m"})
    with pytest.raises(JobError, match="max_tokens was 8, now 9"):
        claim_outputs(paths, other_options, overwrite=False)
    assert paths.results.exists()  # refusing touched nothing

    assert claim_outputs(paths, other_options, overwrite=True) is False
    assert not paths.results.exists()
    assert json.loads(paths.job.read_text())["settings"]["max_tokens"] == 9


def test_a_results_file_without_job_json_is_not_ours(tmp_path: Path) -> None:
    paths = OutputPaths.from_option(tmp_path / "res.jsonl")
    paths.results.write_text('{"some": "thing"}\n')
    job = job_record(Path("in.jsonl"), IDENTITY_A, {})
    with pytest.raises(JobError, match="no res.job.json beside it"):
        claim_outputs(paths, job, overwrite=False)


def test_usage_and_finality() -> None:
    body = {"usage": {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}}
    assert usage_of(body) == (7, 4, 3)
    assert usage_of({"usage": {"prompt_tokens_details": None}}) == (0, 0, 0)
    assert is_final(error_row("a", 1, "http_400", "bad"))
    assert not is_final(error_row("a", 1, "rate_limited", "slow down"))
