"""A CSV input: a prompt column, an id column, the other columns carried to the rows as metadata;
bad records go to the errors file by the line they start on; the job resumes like any other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.cli import main
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.input.reader import read_input
from tokenmill.jobs.input.request import DocumentOptions
from tokenmill.jobs.journal.rows import line_of
from tokenmill.jobs.runner import run_job

from .conftest import EchoBackend, assert_exactly_once, read_jsonl
from .stub_server import StubServer

# Line 1 header (with a byte-order mark), 2 a plain row, 3–4 one row whose quoted question runs over
# two lines and holds a comma, 5 blank, 6 a row short of a field, 7 a duplicate id, 8 an empty
# question, 9 a byte that is not UTF-8, 10 a row after them all.
TABLE = (
    "\ufeffticket,question,lang\n"
    "t1,Is the sky blue?,en\n"
    't2,"Two lines,\nand a comma?",fr\n'
    "\n"
    "t3,short row\n"
    "t1,Again?,en\n"
    "t4,,en\n"
).encode() + b"t5,caf\xe9?,fr\n" + b't6,"Last, ""quoted"" one",de\n'


def write_table(tmp_path: Path, name: str = "tickets.csv", data: bytes = TABLE) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_records_become_requests_with_their_metadata_and_bad_ones_are_named_by_line(tmp_path: Path) -> None:
    options = DocumentOptions(prompt_column="question", id_column="ticket", max_tokens=8)
    spec = read_input(write_table(tmp_path), options)
    assert spec.format == "csv"
    assert [(e.line, e.custom_id) for e in spec.entries] == [(2, "t1"), (3, "t2"), (10, "t6")]
    assert [(e.line, e.custom_id, e.reason) for e in spec.errors] == [
        (6, "t3", "2 field(s), the header has 3"),
        (7, "t1", 'duplicate custom_id "t1" (first seen on line 2)'),
        (8, "t4", "empty document"),
        (9, "t5", "not UTF-8 (in column 'question')"),
    ]
    # The work pass re-reads each record from its offset, a two-line record whole.
    requests = list(spec.requests(reversed(spec.entries)))
    assert [r.body["messages"][-1]["content"] for r in requests] == [
        'Last, "quoted" one', "Two lines,\nand a comma?", "Is the sky blue?"]
    assert [r.metadata for r in requests] == [{"lang": "de"}, {"lang": "fr"}, {"lang": "en"}]
    assert all(r.body["max_tokens"] == 8 for r in requests)


def test_the_default_columns_and_a_tsv(tmp_path: Path) -> None:
    path = write_table(tmp_path, "rows.tsv", b"id\ttext\tscore\n7\tHello there\t0.5\n\tNo id\t1\n")
    spec = read_input(path, DocumentOptions())
    assert [e.custom_id for e in spec.entries] == ["7"]
    assert [(e.line, e.reason) for e in spec.errors] == [(3, "empty id in column 'id'")]
    [request] = spec.requests(spec.entries)
    assert request.body["messages"][-1]["content"] == "Hello there" and request.metadata == {"score": "0.5"}
    # Without an id column, a record's id is the line it starts on (as for text input).
    no_ids = read_input(write_table(tmp_path, "p.csv", b'prompt\n"a\nb"\nc\n'), DocumentOptions())
    assert [e.custom_id for e in no_ids.entries] == ["line-2", "line-4"]


def test_a_header_without_the_prompt_column_refuses_the_whole_file(tmp_path: Path) -> None:
    path = write_table(tmp_path)
    with pytest.raises(ValueError, match=r"no 'prompt' or 'text' column .*prompt_column.*ticket, question, lang"):
        read_input(path, DocumentOptions())
    with pytest.raises(ValueError, match=r"id_column 'nope': the CSV has no such column"):
        read_input(path, DocumentOptions(prompt_column="question", id_column="nope"))
    doubled = write_table(tmp_path, "d.csv", b"prompt,a,a\nx,1,2\n")
    with pytest.raises(ValueError, match="names a column twice: a"):
        read_input(doubled, DocumentOptions())


def test_a_csv_job_writes_its_metadata_beside_each_result_and_resumes(tmp_path: Path, echo: EchoBackend) -> None:
    config = JobConfig(input=write_table(tmp_path), output=tmp_path / "out", progress=False,
                       options=DocumentOptions(prompt_column="question", id_column="ticket"))
    assert run_job(config, echo).status == "failed"  # the bad records failed; the others ran
    out = tmp_path / "out"
    results = {r["custom_id"]: r for r in read_jsonl(out / "results.jsonl")}
    assert {k: r["metadata"] for k, r in results.items()} == {"t1": {"lang": "en"}, "t2": {"lang": "fr"},
                                                              "t6": {"lang": "de"}}
    errors = read_jsonl(out / "errors.jsonl")
    assert sorted(line_of(e) for e in errors) == [6, 7, 8, 9]
    assert errors[0]["error"]["message"] == "line 6: 2 field(s), the header has 3"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"]["max_tokens_defaulted"] == 3 and summary["requests"]["default_max_tokens"] == 256

    # A re-run finds everything done (bad records included) and asks the backend for nothing.
    again = EchoBackend()
    assert run_job(config, again).status == "failed" and again.served == []
    assert_exactly_once(out, 7)


def test_the_command_line_takes_the_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, out = write_table(tmp_path), tmp_path / "o"
    flags = ["-o", str(out), "--no-progress", "--max-tokens", "5"]
    with StubServer() as stub:
        # Without --prompt-column: refused before any request, saying how to name it.
        assert main(["run", str(path), *flags, "--endpoint", stub.url]) == 2
        assert "--prompt-column" in capsys.readouterr().err and not stub.attempts
        assert main(["run", str(path), *flags, "--endpoint", stub.url, "--prompt-column", "question",
                     "--id-column", "ticket"]) == 1  # the bad records failed
    assert sorted(stub.attempts) == ['Is the sky blue?', 'Last, "quoted" one', "Two lines,\nand a comma?"]
    # The endpoint gets a plain request: the metadata stays with the row (OpenAI refuses `metadata`
    # in a chat body unless it stores the completion), and max_tokens is spelled out.
    assert all("metadata" not in body and body["max_tokens"] == 5 for body in stub.bodies)
    results = {r["custom_id"]: r for r in read_jsonl(out / "results.jsonl")}
    assert results["t2"]["metadata"] == {"lang": "fr"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"]["max_tokens_defaulted"] == 3 and summary["requests"]["default_max_tokens"] == 5
