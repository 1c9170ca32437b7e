"""Structured outputs in a job: `--json-schema` / `--choice` / `--regex` fill the rows that ask for
none of their own, a bad setting is that row's error row, a changed setting is another job, and
the summary counts the constrained answers max_tokens cut short."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from rich.console import Console

from tokenmill import LLM
from tokenmill.cli import main
from tokenmill.engine import StructuredOutputsParams
from tokenmill.jobs.backends.embedded import EmbeddedBackend
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.errors import JobError
from tokenmill.jobs.input.reader import read_input
from tokenmill.jobs.input.request import DocumentOptions
from tokenmill.jobs.runner import run_job
from tokenmill.jobs.summary import print_summary
from tokenmill.models.loader import LoadedWeights
from tokenmill.openai_compat import structured_outputs, structured_outputs_body

from .conftest import EchoBackend, batch_line, read_jsonl, write_jsonl
from .stub_server import StubServer

LABELS = ["positive", "negative"]
SCHEMA = {"type": "object", "properties": {"label": {"enum": LABELS}}, "required": ["label"],
          "additionalProperties": False}
SYSTEM = "Say whether the review is positive or negative."


def fill(setting: StructuredOutputsParams, **kw) -> DocumentOptions:
    return DocumentOptions(structured_outputs=structured_outputs_body(setting), **kw)


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")


def test_the_setting_fills_only_rows_that_ask_for_none(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [
        batch_line("plain", "x"),
        batch_line("own", "x", guided_regex="[0-9]+"),
        batch_line("json-mode", "x", response_format={"type": "json_object"}),
        batch_line("text", "x", response_format={"type": "text"}),  # OpenAI's default: asks for none
    ])
    spec = read_input(path, fill(StructuredOutputsParams(json=SCHEMA)))
    settings = {r.custom_id: structured_outputs(r.body) for r in spec.requests(spec.entries)}
    assert settings == {"plain": StructuredOutputsParams(json=SCHEMA), "own": StructuredOutputsParams(regex="[0-9]+"),
                        "json-mode": StructuredOutputsParams(json_object=True),
                        "text": StructuredOutputsParams(json=SCHEMA)}
    assert all(e.structured for e in spec.entries)
    assert not any(e.structured for e in read_input(path, DocumentOptions()).entries[:1])


def test_endpoint_jobs_send_the_setting_as_body_fields(tmp_path: Path) -> None:
    """Before any backend sees a row: the endpoint gets OpenAI's `response_format` for a schema
    and vLLM's `structured_outputs` for a choice or regex."""
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", "x"), batch_line("b", "y", guided_choice=["z"])])
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    with StubServer() as stub:
        assert main(["run", str(path), "-o", str(tmp_path / "s"), "--endpoint", stub.url, "--no-progress",
                     "--json-schema", str(schema)]) == 0
        assert main(["run", str(path), "-o", str(tmp_path / "c"), "--endpoint", stub.url, "--no-progress",
                     "--choice", " positive , negative"]) == 0
    bodies = {(b["messages"][0]["content"], i // 2): b for i, b in enumerate(stub.bodies)}
    assert bodies["x", 0]["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA, "strict": True}}
    assert bodies["x", 1]["structured_outputs"] == {"choice": LABELS}  # labels stripped
    assert bodies["y", 0]["guided_choice"] == bodies["y", 1]["guided_choice"] == ["z"]
    assert "response_format" not in bodies["y", 0] and "structured_outputs" not in bodies["y", 1]


@pytest.mark.parametrize(("flags", "words"), [
    (["--choice", ""], "--choice must be a non-empty list of non-empty strings"),
    (["--choice", "a,,b"], "--choice must be a non-empty list of non-empty strings, got ['a', '', 'b']"),
    (["--regex", ""], "--regex must be a non-empty string"),
    (["--json-schema", "missing.json"], "--json-schema missing.json: cannot read it (No such file or directory)"),
    (["--json-schema", "in.jsonl"], "--json-schema in.jsonl: not JSON (Extra data"),
    (["--json-schema", "list.json"], "--json-schema must be a JSON schema (an object), got list"),
])
def test_an_unusable_flag_stops_the_job_before_it_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str], flags: list[str],
                                                         words: str) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "in.jsonl", [batch_line("a", "x"), batch_line("b", "y")])
    (tmp_path / "list.json").write_text("[1]")
    assert main(["run", "in.jsonl", "-o", "out", *flags]) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_flags_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "in.jsonl", "-o", "out", "--choice", "a,b", "--regex", "a"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_changed_setting_is_a_different_job(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", "x")])

    def job(options: DocumentOptions, overwrite: bool = False) -> JobConfig:
        return JobConfig(input=path, output=tmp_path / "out", options=options, progress=False, overwrite=overwrite)

    assert run_job(job(DocumentOptions()), EchoBackend()).status == "done"
    record = json.loads((tmp_path / "out/job.json").read_text())
    assert "structured_outputs" not in record["settings"]  # so jobs from before the option still resume
    with pytest.raises(JobError, match="structured_outputs was unset, now"):
        run_job(job(fill(StructuredOutputsParams(json=SCHEMA))), EchoBackend())
    assert run_job(job(fill(StructuredOutputsParams(json=SCHEMA)), overwrite=True), EchoBackend()).status == "done"
    other = {**SCHEMA, "required": []}
    with pytest.raises(JobError, match=r"structured_outputs was .*'required': \['label'\].* now .*'required': \[\]"):
        run_job(job(fill(StructuredOutputsParams(json=other))), EchoBackend())
    assert run_job(job(fill(StructuredOutputsParams(json=SCHEMA))), EchoBackend()).status == "done"  # the same: resumes


@pytest.fixture(scope="module")
def llm(smollm_weights: LoadedWeights) -> LLM:
    return LLM(weights=smollm_weights, max_num_seqs=4, num_kv_blocks=96, max_model_len=384)


REVIEWS = {"good": "The kettle boils fast and looks great.", "bad": "The lid broke after a week."}


@pytest.mark.slow  # the module's first generation: the engine warms up (~7 s on 2 busy cores)
def test_documents_get_the_schema_and_every_answer_validates(tmp_path: Path, llm: LLM) -> None:
    documents = write_jsonl(tmp_path / "docs.jsonl", [
        {"id": "prompt", "prompt": REVIEWS["good"]},
        {"id": "chat", "messages": [{"role": "user", "content": REVIEWS["bad"]}]},
    ])
    options = fill(StructuredOutputsParams(json=SCHEMA), system=SYSTEM, max_tokens=24, temperature=0)
    assert run_job(JobConfig(input=documents, output=tmp_path / "out", options=options, progress=False),
                   EmbeddedBackend(llm=llm)).status == "done"
    rows = read_jsonl(tmp_path / "out/results.jsonl")
    assert len(rows) == 2
    for row in rows:
        choice = row["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_a_bad_row_is_an_error_row_and_cut_answers_are_counted(
        tmp_path: Path, llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    batch = write_jsonl(tmp_path / "batch.jsonl", [
        batch_line("choice", REVIEWS["bad"], guided_choice=LABELS),
        batch_line("regex", "x", guided_regex="a(("),  # does not compile: this row's error, the job goes on
        batch_line("cut", REVIEWS["good"], max_tokens=2, response_format={"type": "json_object"}),
        batch_line("free", "x", max_tokens=2, response_format={"type": "text"}),  # cut, but free text
    ])
    config = JobConfig(input=batch, output=tmp_path / "out", options=DocumentOptions(temperature=0), progress=False)
    outcome = run_job(config, EmbeddedBackend(llm=llm))
    assert outcome.status == "failed"  # the bad row failed
    results = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in read_jsonl(tmp_path / "out/results.jsonl")}
    assert results["choice"]["message"]["content"] in LABELS
    assert results["cut"]["finish_reason"] == results["free"]["finish_reason"] == "length"
    [error] = read_jsonl(tmp_path / "out/errors.jsonl")
    assert error["custom_id"] == "regex" and error["error"]["code"] == "invalid_input"
    assert error["error"]["message"].startswith("line 2: body.guided_regex: ")
    assert "unclosed group" in error["error"]["message"]
    summary = json.loads((tmp_path / "out/summary.json").read_text())["requests"]
    assert (summary["structured"], summary["structured_cut"]) == (2, 1)
    print_summary(outcome, Console())
    assert "structured │ 2 request(s) · 1 cut by max_tokens" in capsys.readouterr().out

    # resumed: nothing to run, the count still there
    assert run_job(config, EmbeddedBackend(llm=llm)).status == "failed"
    assert json.loads((tmp_path / "out/summary.json").read_text())["requests"]["structured_cut"] == 1
