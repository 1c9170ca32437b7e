"""`--output-format parquet` on a local folder: parts written as the job goes, a killed run's
journal tail committed on resume, a part without its sidecar written again, the columns promised."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from tokenmill.cli import main
from tokenmill.jobs.backends.base import BackendStats, ResultSink, StopFlag
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.input.request import BatchRequest, DocumentOptions
from tokenmill.jobs.journal.parquet import SCHEMA
from tokenmill.jobs.journal.parts import PartSealer
from tokenmill.jobs.runner import run_job

from .conftest import EchoBackend, batch_line, read_jsonl, write_jsonl
from .stub_server import StubServer

ROWS = 20


class AnswerBackend(EchoBackend):
    """Answers "answer to ID" at once, as a chat completion; stops the job after `stop_after` results."""

    def __init__(self, stop_after: int | None = None) -> None:
        super().__init__()
        self.stop_after = stop_after

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        for request in requests:
            if stop.requested:
                break
            self.served.append(request.custom_id)
            choice = {"index": 0, "message": {"role": "assistant", "content": f"answer to {request.custom_id}"},
                      "finish_reason": "stop"}
            usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                     "prompt_tokens_details": {"cached_tokens": 2}}
            sink.result(request, {"object": "chat.completion", "model": "echo", "choices": [choice], "usage": usage})
            if self.stop_after is not None and len(self.served) >= self.stop_after:
                stop.request()
        return BackendStats()


def job(tmp_path: Path, rows: int = ROWS) -> JobConfig:
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line(f"r-{i:02d}", f"question {i}") for i in range(rows)])
    return JobConfig(input=path, output=tmp_path / "out", progress=False, options=DocumentOptions(max_tokens=4),
                     output_format="parquet", part_rows=3)


def parts_table(out: Path) -> pa.Table:
    return ds.dataset(out / "results", format="parquet").to_table()


def no_last_part(self: PartSealer, records: int, end: int) -> None:
    """PartSealer.close as a kill -9 leaves it: the parts sealed so far, not the rows since."""
    if self._thread is not None:
        self._queue.put(None)
        self._thread.join()


def test_a_killed_job_resumes_and_the_parts_hold_every_row_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config, out = job(tmp_path), tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(PartSealer, "close", no_last_part)
        first = run_job(config, AnswerBackend(stop_after=8))
    assert first.interrupted and first.requests.done == 8
    assert sorted(p.name for p in (out / "results").iterdir()) == ["part-00001.parquet", "part-00002.parquet"]
    assert parts_table(out).num_rows == 6  # rows 7 and 8 are only in the journal

    backend = AnswerBackend()
    outcome = run_job(config, backend)
    assert outcome.status == "done" and outcome.requests.done == ROWS and outcome.requests.done_this_run == 12
    assert "committed 2 row(s) the last run left in its journal" in capsys.readouterr().err
    assert len(backend.served) == 12 and not set(backend.served) & {f"r-{i:02d}" for i in range(8)}
    table = parts_table(out)
    assert table.schema == SCHEMA
    ids = table.column("custom_id").to_pylist()
    assert sorted(ids) == [f"r-{i:02d}" for i in range(ROWS)]  # each exactly once
    first_row = table.filter(ds.field("custom_id") == "r-00").to_pylist()[0]
    assert first_row["content"] == "answer to r-00" and first_row["finish_reason"] == "stop"
    assert (first_row["status_code"], first_row["model"]) == (200, "echo")
    assert (first_row["prompt_tokens"], first_row["completion_tokens"], first_row["total_tokens"],
            first_row["cached_tokens"]) == (7, 3, 10, 2)
    assert json.loads(first_row["body"])["choices"][0]["message"]["content"] == "answer to r-00"
    assert first_row["error_code"] is None and first_row["error_message"] is None and first_row["metadata"] is None
    assert first_row["id"].startswith("batch_req_") and first_row["request_id"]
    # The journal beside the parts holds the same rows; the sidecars their done-index records.
    assert sorted(r["custom_id"] for r in read_jsonl(out / "results.jsonl")) == sorted(ids)
    parts = sorted((out / "results").iterdir())
    assert [p.name.replace(".parquet", ".index") for p in parts] == sorted(p.name for p in (out / "index").iterdir())


def test_a_part_without_its_sidecar_is_not_committed(tmp_path: Path) -> None:
    config, out = job(tmp_path), tmp_path / "out"
    run_job(config, AnswerBackend(stop_after=7))  # parts of 3, 3, 1 (the last at the end of the run)
    (out / "index" / "part-00003.index").unlink()  # as if killed between the data part and its sidecar
    outcome = run_job(config, AnswerBackend())
    assert outcome.requests.done == ROWS
    assert sorted(parts_table(out).column("custom_id").to_pylist()) == [f"r-{i:02d}" for i in range(ROWS)]


def test_a_csv_job_keeps_its_columns_as_metadata_and_overwrite_clears_the_parts(tmp_path: Path) -> None:
    path = tmp_path / "tickets.csv"
    path.write_text("ticket_id,body,team\nt1,refund please,billing\nt2,app crashes,mobile\n")
    out = tmp_path / "out"
    flags = ["run", str(path), "-o", str(out), "--id-column", "ticket_id", "--prompt-column", "body",
             "--output-format", "parquet", "--part-rows", "1", "--no-progress", "--endpoint"]
    with StubServer() as stub:
        assert main([*flags, stub.url]) == 0
        assert len(list((out / "results").iterdir())) == 2
        rows = {r["custom_id"]: r for r in parts_table(out).to_pylist()}
        assert rows["t1"]["metadata"] == [("team", "billing")] and rows["t2"]["content"] == "echo: app crashes"
        assert main([*flags, stub.url, "--overwrite", "--part-rows", "5"]) == 0
    assert [p.name for p in (out / "results").iterdir()] == ["part-00001.parquet"]
    assert parts_table(out).num_rows == 2


def test_parquet_needs_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", "x")])
    assert main(["run", str(path), "-o", str(tmp_path / "res.jsonl"), "--output-format", "parquet"]) == 2
    assert "--output-format parquet writes a folder" in capsys.readouterr().err
