"""The job flow on a fake backend: bad lines, resume, exactly once, refusals, summary, CLI wiring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from tokenmill.cli import main
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.errors import JobError
from tokenmill.jobs.input.request import DocumentOptions, Entry
from tokenmill.jobs.journal.rows import encode_row, line_of, result_row
from tokenmill.jobs.runner import order_entries, run_job
from tokenmill.jobs.summary import print_summary

from .conftest import EchoBackend, assert_exactly_once, batch_line, read_jsonl, write_jsonl


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")


def mixed_input(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "in.jsonl", [
        batch_line("a", "one"),
        batch_line("b", "final-fail"),
        "not json",
        batch_line("c", "flaky"),
        batch_line("d", "refuse"),
        batch_line("a", "duplicate"),
        batch_line("e", "five"),
    ])


def config(tmp_path: Path, input_path: Path, **kw) -> JobConfig:
    return JobConfig(input=input_path, output=tmp_path / "out", progress=False,
                     options=kw.pop("options", DocumentOptions(max_tokens=4)), **kw)


def test_bad_lines_are_recorded_and_the_good_ones_run(tmp_path: Path, echo: EchoBackend) -> None:
    path = mixed_input(tmp_path)
    assert run_job(config(tmp_path, path), echo).status == "failed"  # some failed
    out = tmp_path / "out"
    assert [r["custom_id"] for r in read_jsonl(out / "results.jsonl")] == ["a", "e"]
    error_rows = read_jsonl(out / "errors.jsonl")
    # OpenAI's error row, its error with the input line as data (`line`, as OpenAI's batch errors
    # name it), which also leads the message for whoever reads the file.
    assert all(set(e) == {"id", "custom_id", "response", "error"} for e in error_rows)
    assert all(set(e["error"]) == {"code", "message", "line"} for e in error_rows)
    assert all(e["error"]["message"].startswith(f"line {e['error']['line']}: ") for e in error_rows)
    errors = {(line_of(e), e["error"]["code"]) for e in error_rows}
    assert errors == {(3, "invalid_input"), (5, "invalid_input"), (6, "invalid_input"),
                      (2, "http_400"), (4, "server_error")}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == {"total": 7, "done": 2, "failed": 5, "not_done": 0, "invalid_lines": 3,
                                   "retryable": 1, "done_this_run": 2, "failed_this_run": 2,
                                   "structured": 0, "structured_cut": 0,
                                   "max_tokens_defaulted": 4, "default_max_tokens": 4}
    assert summary["tokens"] == {"prompt": 20, "cached": 6, "completion": 8, "vectors": 0}
    job = json.loads((out / "job.json").read_text())
    assert job["settings"]["max_tokens"] == 4 and len(job["input_identity"]["ends_sha256"]) == 64

    # The re-run retries only the transient failure; the final ones and bad lines stay as they are.
    again = EchoBackend()
    again.flaky_failed = {"c"}
    assert run_job(config(tmp_path, path), again).status == "failed"
    assert again.served == ["c"]
    assert_exactly_once(out, 7)
    assert [r["custom_id"] for r in read_jsonl(out / "results.jsonl")] == ["a", "e", "c"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"]["done"] == 3 and summary["requests"]["retryable"] == 0

    third = EchoBackend()
    assert run_job(config(tmp_path, path), third).status == "failed" and third.served == []
    assert_exactly_once(out, 7)


def test_strict_refuses_and_touches_nothing(tmp_path: Path, echo: EchoBackend) -> None:
    with pytest.raises(JobError, match=r"3 bad line\(s\), nothing was run \(--strict\):\n  line 3: not JSON"):
        run_job(config(tmp_path, mixed_input(tmp_path), strict=True), echo)
    assert echo.served == [] and not (tmp_path / "out").exists()


def test_resume_after_a_torn_write(tmp_path: Path, echo: EchoBackend, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line(f"r-{i}", f"text {i}") for i in range(6)])
    run_job(config(tmp_path, path), EchoBackend())
    results = tmp_path / "out/results.jsonl"
    kept = results.read_bytes().splitlines(keepends=True)[:2]
    results.write_bytes(b"".join(kept) + b'{"id": "batch_req_1", "custom_id": "r-2", "resp')  # as if killed
    assert run_job(config(tmp_path, path), echo).status == "done"
    assert echo.served == ["r-2", "r-3", "r-4", "r-5"]
    assert_exactly_once(tmp_path / "out", 6)
    err = capsys.readouterr().err
    assert "repaired a torn last line (47 bytes cut)" in err and "resuming: 2 done" in err


def test_a_different_job_is_refused(tmp_path: Path, echo: EchoBackend) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", "x")])
    run_job(config(tmp_path, path), echo)
    with pytest.raises(JobError, match="max_tokens was 4, now 5.*--overwrite"):
        run_job(config(tmp_path, path, options=DocumentOptions(max_tokens=5)), echo)
    write_jsonl(path, [batch_line("a", "x"), batch_line("b", "y")])
    with pytest.raises(JobError, match="the input differs"):
        run_job(config(tmp_path, path), echo)
    assert run_job(config(tmp_path, path, overwrite=True), EchoBackend()).status == "done"
    assert_exactly_once(tmp_path / "out", 2)
    with pytest.raises(JobError, match="temperature was unset, now 0.5"):  # not "was None"
        run_job(config(tmp_path, path, options=DocumentOptions(max_tokens=4, temperature=0.5)), echo)


class SignalAfterLastRow(EchoBackend):
    """A SIGTERM that arrives once every row is written (a supervisor's stop, a tidy Ctrl-C)."""

    def run(self, requests, sink, stop):  # type: ignore[no-untyped-def]
        stats = super().run(requests, sink, stop)
        stop.request()
        return stats


def test_a_signal_after_the_last_row_is_not_an_interruption(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", "x"), batch_line("b", "y")])
    assert run_job(config(tmp_path, path), SignalAfterLastRow()).status == "done"
    assert "Re-run" not in capsys.readouterr().err
    assert json.loads((tmp_path / "out/summary.json").read_text())["interrupted"] is False


def test_cost_in_the_summary(tmp_path: Path, echo: EchoBackend, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line(f"r-{i}", "x") for i in range(3)])
    outcome = run_job(config(tmp_path, path, price_per_hour=2.0), echo)
    assert capsys.readouterr().out == ""  # printing is the caller's (the server runs jobs too)
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert summary == outcome.to_json()
    print_summary(outcome, Console())
    rate, cost = summary["throughput"]["output_tok_s"], summary["cost"]
    assert summary["tokens"]["completion"] == 12 and rate > 0
    assert cost["usd_per_million_output_tokens"] == pytest.approx(2.0 / (rate * 3600) * 1e6, rel=1e-3)
    assert cost["million_output_tokens_per_usd"] == pytest.approx(1 / cost["usd_per_million_output_tokens"], rel=1e-3)
    out = capsys.readouterr().out
    assert "3 done · 0 failed · 0 not done of 3" in out and "per M output tokens" in out


def test_length_buckets_put_the_biggest_first() -> None:
    entries = [Entry(i, 0, f"r{i}", cost) for i, cost in enumerate([10, 300, 12, 700, 260, 9])]
    ordered = order_entries(entries, "length-buckets")
    assert [e.custom_id for e in ordered] == ["r3", "r1", "r4", "r0", "r2", "r5"]  # 2**k buckets
    assert order_entries(entries, "input") == entries


def test_the_cli_wires_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", "x")])
    out = tmp_path / "res.jsonl"
    out.write_text(encode_row(result_row("zzz", {})).decode())  # someone else's file
    assert main(["run", str(path), "-o", str(out), "--no-progress"]) == 2
    assert "was not started by this job" in capsys.readouterr().err
    assert main(["run", str(path), "-o", str(out), "--template", "no placeholder"]) == 2
    assert '--template must contain "{text}"' in capsys.readouterr().err
