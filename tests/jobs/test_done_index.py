"""The done-index: a re-run learns what is done from it, not from the rows, and stays exactly once
whatever a kill, a torn write or a power cut left; the input is read as the backend asks."""

from __future__ import annotations

import itertools
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from tokenmill.jobs import runner
from tokenmill.jobs.backends.base import ResultSink, StopFlag
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.errors import JobError
from tokenmill.jobs.input.reader import DoneLines, InputStream
from tokenmill.jobs.input.request import BatchRequest, DocumentOptions
from tokenmill.jobs.input.seen_ids import FLUSH_EVERY, SeenIds, id_key
from tokenmill.jobs.journal.index import ENDED_BY_LENGTH, INDEX_HEADER, INDEX_RECORD, create_index, read_index
from tokenmill.jobs.journal.paths import OutputPaths
from tokenmill.jobs.journal.rows import encode_row, result_row
from tokenmill.jobs.journal.writers import IndexedResults
from tokenmill.jobs.runner import run_job

from .conftest import EchoBackend, assert_exactly_once, batch_line, read_jsonl, write_jsonl
from .stub_server import StubServer

QUIET = Console(file=open("/dev/null", "w"))  # noqa: SIM115 (lives as long as the tests)


def config(tmp_path: Path, input_path: Path, **kw) -> JobConfig:
    return JobConfig(input=input_path, output=tmp_path / "out", progress=False,
                     options=DocumentOptions(max_tokens=4), **kw)


class StopAfter(EchoBackend):
    """Serves `n` requests, then asks the job to stop (as a Ctrl-C would)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def run(self, requests, sink: ResultSink, stop: StopFlag):  # type: ignore[no-untyped-def]
        def counted():
            for request in requests:
                if len(self.served) >= self.n:
                    stop.request()
                yield request
        return super().run(counted(), sink, stop)


def lines(n: int) -> list[dict]:
    return [batch_line(f"r{i}", f"text {i}") for i in range(n)]


def test_a_rerun_skips_done_lines_unread_and_still_catches_a_duplicate_of_one(tmp_path: Path) -> None:
    rows = lines(6) + [batch_line("r1", "a duplicate of a line done in the first run")]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    first = run_job(config(tmp_path, path), StopAfter(3), QUIET)
    assert first.status == "interrupted" and first.requests.done == 3
    second = EchoBackend()
    outcome = run_job(config(tmp_path, path), second, QUIET)
    assert second.served == ["r3", "r4", "r5"]  # the done lines were not sent again
    assert outcome.requests.done == 6 and outcome.requests.invalid_lines == 1
    errors = read_jsonl(tmp_path / "out/errors.jsonl")
    assert [e["error"]["message"] for e in errors] == ['line 7: duplicate custom_id "r1" (first seen on line 2)']


def test_a_record_whose_row_never_came_is_dropped_and_the_row_done_once(tmp_path: Path) -> None:
    """kill -9 between the record and the row: the record ends past the results file."""
    path = write_jsonl(tmp_path / "in.jsonl", lines(5))
    run_job(config(tmp_path, path), StopAfter(2), QUIET)
    paths = OutputPaths.from_option(tmp_path / "out")
    size = paths.results.stat().st_size
    record = np.array([(5, 0, 123, size + 300)], INDEX_RECORD)  # line 5, a row that was never written
    with paths.index.open("ab") as f:
        f.write(record.tobytes())
    outcome = run_job(config(tmp_path, path), EchoBackend(), QUIET)
    assert outcome.requests.done == 5 and outcome.requests.done_this_run == 3
    assert_exactly_once(tmp_path / "out", 5)
    assert (paths.index.stat().st_size - INDEX_HEADER) // INDEX_RECORD.itemsize == 5


def test_rows_without_records_and_a_torn_record_are_cut_and_done_again(tmp_path: Path) -> None:
    """After a power cut the results may hold rows the index never heard of (redone, not doubled),
    and the index half a record."""
    path = write_jsonl(tmp_path / "in.jsonl", lines(5))
    run_job(config(tmp_path, path), StopAfter(2), QUIET)
    paths = OutputPaths.from_option(tmp_path / "out")
    with paths.results.open("ab") as f:
        f.write(encode_row(result_row("r2", {"choices": []})))
        f.write(b'{"id": "torn')
    with paths.index.open("ab") as f:
        f.write(b"\x01\x02\x03")
    outcome = run_job(config(tmp_path, path), EchoBackend(), QUIET)
    assert outcome.requests.done == 5
    assert_exactly_once(tmp_path / "out", 5)
    assert sorted(r["custom_id"] for r in read_jsonl(paths.results)) == [f"r{i}" for i in range(5)]


def test_a_record_over_bytes_that_are_not_its_row_is_dropped(tmp_path: Path) -> None:
    """A power cut can keep a file's length but not its last bytes (zeros): the last record's row
    is read back and checked before it is believed."""
    path = write_jsonl(tmp_path / "in.jsonl", lines(4))
    run_job(config(tmp_path, path), StopAfter(2), QUIET)
    paths = OutputPaths.from_option(tmp_path / "out")
    data = paths.results.read_bytes()
    last_start = data.rindex(b"\n", 0, len(data) - 1) + 1
    paths.results.write_bytes(data[:last_start] + b"\0" * (len(data) - last_start))
    outcome = run_job(config(tmp_path, path), EchoBackend(), QUIET)
    assert outcome.requests.done == 4
    assert_exactly_once(tmp_path / "out", 4)


def test_a_job_of_an_older_layout_is_refused_with_how_to_finish_it(tmp_path: Path) -> None:
    """Version 2 kept an error row's line only in its message: resuming one with this version would
    not know its failed lines. It is refused, its files untouched, and --overwrite starts it over."""
    path = write_jsonl(tmp_path / "in.jsonl", lines(4))
    run_job(config(tmp_path, path), StopAfter(2), QUIET)
    paths = OutputPaths.from_option(tmp_path / "out")
    paths.job.write_text(json.dumps({**json.loads(paths.job.read_text()), "version": 2}))
    before = {f: f.read_bytes() for f in (paths.results, paths.index, paths.job)}
    with pytest.raises(JobError, match="job format 2; this one reads 3.*the tokenmill that began it.*--overwrite"):
        run_job(config(tmp_path, path), EchoBackend(), QUIET)
    assert {f: f.read_bytes() for f in before} == before
    outcome = run_job(config(tmp_path, path, overwrite=True), EchoBackend(), QUIET)
    assert outcome.requests.done == 4
    assert_exactly_once(tmp_path / "out", 4)


def test_an_index_that_does_not_match_its_results_is_not_believed(tmp_path: Path) -> None:
    """Rows deleted by hand (to have them done again): the index still lists them, but its records
    no longer land on their rows, so the results are read instead; the deleted rows are redone."""
    path = write_jsonl(tmp_path / "in.jsonl", lines(6))
    run_job(config(tmp_path, path), EchoBackend(), QUIET)
    paths = OutputPaths.from_option(tmp_path / "out")
    kept = [row for row in read_jsonl(paths.results) if row["custom_id"] not in ("r1", "r4")]
    write_jsonl(paths.results, kept)
    echo = EchoBackend()
    messages = Console(record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    outcome = run_job(config(tmp_path, path), echo, messages)
    assert sorted(echo.served) == ["r1", "r4"] and outcome.requests.done == 6
    assert "did not match results.jsonl" in messages.export_text()
    assert_exactly_once(tmp_path / "out", 6)


def test_seen_ids_find_duplicates_across_merges_with_their_first_line() -> None:
    seen = SeenIds()
    n = 2 * FLUSH_EVERY + 123
    assert all(seen.add(f"id-{i}", i + 1) is None for i in range(n))
    assert len(seen) == n
    rng = random.Random(0)
    for i in rng.sample(range(n), 50):
        assert seen.add(f"id-{i}", n + 10) == i + 1
    seeded = SeenIds()
    seeded.seed(np.array([id_key("a"), id_key("b")]), np.array([7, 9]))
    assert (seeded.add("b", 20), seeded.add("a", 21), seeded.add("c", 22)) == (9, 7, None)


@pytest.mark.slow
def test_kill_9_at_five_random_points_then_every_row_exactly_once(tmp_path: Path) -> None:
    n = 3000
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line(f"r{i}", f"doc {i}", max_tokens=4) for i in range(n)])
    out = tmp_path / "out"
    rng = random.Random(30)
    with StubServer(max_requests=10 * n) as stub:
        cmd = [sys.executable, "-m", "tokenmill", "run", str(path), "-o", str(out), "--endpoint", stub.url,
               "--concurrency", "32", "--no-progress"]
        for point in sorted(rng.sample(range(100, n - 100), 5)):
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 60
            while _lines(out / "results.jsonl") < point:
                assert proc.poll() is None and time.monotonic() < deadline, f"no {point} rows"
                time.sleep(0.005)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert rerun.returncode == 0, rerun.stderr
        assert "resuming:" in rerun.stderr
        assert sum(stub.attempts.values()) >= n  # some were in flight at a kill and sent again
    assert_exactly_once(out, n)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"]["done"] == n and summary["requests"]["not_done"] == 0


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_the_first_request_goes_out_before_the_input_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend sees its first request while most of the file is still unread: the job does not
    validate the whole input first (a bad line far down is still reported, by its line)."""
    path = write_jsonl(tmp_path / "in.jsonl", [*lines(2000), "not json"])
    streams: list[InputStream] = []
    monkeypatch.setattr(runner, "InputStream", lambda *a, **kw: streams.append(InputStream(*a, **kw)) or streams[-1])
    read_when_first_sent: list[int] = []

    class Watching(EchoBackend):
        def run(self, requests, sink, stop):  # type: ignore[no-untyped-def]
            first = next(requests)
            read_when_first_sent.append(streams[0].records)
            return super().run(itertools.chain([first], requests), sink, stop)

    outcome = run_job(config(tmp_path, path), Watching(), QUIET)
    assert read_when_first_sent[0] < 10
    assert outcome.requests.total == 2001 and outcome.requests.invalid_lines == 1
    assert read_jsonl(tmp_path / "out/errors.jsonl")[0]["error"]["message"].startswith("line 2001: not JSON")


def test_the_sink_writes_the_record_before_the_row(tmp_path: Path) -> None:
    paths = OutputPaths.from_option(tmp_path / "out")
    create_index(paths.index, 0)
    results = IndexedResults(paths.results, paths.index, fsync_interval=0)
    sink = ResultSink(results, results, None)
    sink.result(BatchRequest(7, "x", "/v1/completions", {"prompt": "p", "max_tokens": 3}),
                {"choices": [{"text": "t", "finish_reason": "length"}]})
    results.close()
    found = read_index(paths.index, paths.results)
    assert found is not None
    records, base, cut = found
    assert (base, cut, len(records)) == (0, 0, 1)
    assert int(records["line"][0]) == 7 and int(records["end"][0]) == paths.results.stat().st_size
    assert int(records["flags"][0]) == ENDED_BY_LENGTH


def test_done_lines_are_runs_that_a_rerun_passes_over_whole() -> None:
    rng = np.random.default_rng(0)
    done = rng.random(500) < 0.7
    done[0] = False  # line 0 is never a line
    runs = DoneLines(done)
    for line in range(len(done) + 3):
        expected = 0
        while line + expected < len(done) and done[line + expected]:
            expected += 1
        assert runs.run_from(line) == expected, line
        assert (line in runs) == (expected > 0)


class EveryOther(EchoBackend):
    """Answers every other request it is handed and leaves the rest not done (no row)."""

    def run(self, requests, sink: ResultSink, stop: StopFlag):  # type: ignore[no-untyped-def]
        return super().run(itertools.islice(requests, 0, None, 2), sink, stop)


@pytest.mark.parametrize("suffix", [".txt", ".csv"])
def test_a_rerun_over_scattered_done_lines_and_blank_lines_runs_the_rest_and_counts_every_line(
    tmp_path: Path, suffix: str
) -> None:
    """Runs of done lines are passed over unread (text) or a record at a time (CSV): either way
    the rest run once, and the summary counts every request the input has."""
    header = ["id,prompt"] if suffix == ".csv" else []
    body = [f"d{i},doc {i}" if suffix == ".csv" else f"doc {i}" for i in range(40)]
    for blank in (30, 17, 9, 3):  # blank lines are not requests, and keep their line numbers
        body.insert(blank, "")
    path = tmp_path / f"in{suffix}"
    path.write_text("\n".join(header + body) + "\n\n")
    cfg = config(tmp_path, path)
    first = EveryOther()
    run_job(cfg, StopAfter(5), console=QUIET)  # a done prefix, then every other line of the rest
    run_job(cfg, first, console=QUIET)
    second = EchoBackend()
    outcome = run_job(cfg, second, console=QUIET)
    assert outcome.status == "done" and outcome.requests.total == 40 and outcome.requests.done == 40
    assert len(first.served) == 18 and len(second.served) == 17 and not set(first.served) & set(second.served)
    ids = [row["custom_id"] for row in read_jsonl(tmp_path / "out" / "results.jsonl")]
    assert len(ids) == len(set(ids)) == 40
