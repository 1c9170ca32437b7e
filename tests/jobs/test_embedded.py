"""End to end on the embedded model (tiny inputs: a handful of requests, max_tokens <= 8)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from tokenmill import LLM, SamplingParams
from tokenmill.jobs.backends.base import BackendStats, ResultSink, StopFlag
from tokenmill.jobs.backends.embedded import EmbeddedBackend
from tokenmill.jobs.cli import finish
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.errors import ExitCode
from tokenmill.jobs.input.request import BatchRequest, DocumentOptions
from tokenmill.jobs.journal.rows import line_of
from tokenmill.jobs.runner import run_job
from tokenmill.models.loader import LoadedWeights

from .conftest import assert_exactly_once, batch_line, read_jsonl, write_jsonl

SYSTEM = ("You sort customer reviews for an online shop into positive, negative or mixed and say why "
          "in a few words. Be brief and do not repeat the review.")


@pytest.fixture(scope="module")
def llm(smollm_weights: LoadedWeights) -> LLM:
    return LLM(weights=smollm_weights, max_num_seqs=4, num_kv_blocks=96, max_model_len=384)


def chat_line(custom_id: str, review: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": review}]}}


def test_run_logprobs_flag_puts_logprobs_in_every_result_row(tmp_path: Path, llm: LLM) -> None:
    """`tokenmill run --logprobs 2`: the flag reaches every body in its own words, and each result row
    carries OpenAI's logprobs shape for its endpoint, one entry per answer token."""
    from tokenmill.cli import build_parser
    from tokenmill.jobs.flags import job_config

    rows = [chat_line("chat", "The kettle boils fast."), batch_line("text", "The capital of France is",
                                                                      url="/v1/completions")]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    args = build_parser().parse_args(["run", str(path), "-o", str(tmp_path / "out"), "--logprobs", "2",
                                      "--max-tokens", "4", "--temperature", "0", "--no-progress"])
    assert run_job(job_config(args), EmbeddedBackend(llm=llm)).status == "done"
    bodies = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(tmp_path / "out/results.jsonl")}
    chat, text = bodies["chat"], bodies["text"]
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 and bytes(t["bytes"]).decode() == t["token"]
               for t in content)
    logprobs = text["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == text["usage"]["completion_tokens"]
    assert "".join(logprobs["tokens"]) == text["choices"][0]["text"]
    assert all(token in top for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True))


@pytest.mark.slow
def test_batch_job_end_to_end(tmp_path: Path, llm: LLM) -> None:
    rows = [
        chat_line("good", "The kettle boils fast and looks great."),
        chat_line("bad", "The lid broke after a week."),
        batch_line("plain", "The capital of France is", url="/v1/completions"),
        chat_line("huge", "word " * 600),  # longer than the 384-token context: refused, the job goes on
        '{"custom_id": "broken"',
    ]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    config = JobConfig(input=path, output=tmp_path / "out", options=DocumentOptions(max_tokens=6, temperature=0),
                       progress=False)
    assert run_job(config, EmbeddedBackend(llm=llm)).status == "failed"

    results = {r["custom_id"]: r for r in read_jsonl(tmp_path / "out/results.jsonl")}
    assert sorted(results) == ["bad", "good", "plain"]
    chat = results["good"]["response"]
    assert chat["status_code"] == 200 and results["good"]["error"] is None
    body = chat["body"]
    assert body["object"] == "chat.completion" and body["model"] == "SmolLM2-135M-Instruct.Q4_1"
    usage = body["usage"]
    assert usage["completion_tokens"] <= 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # Greedy: the job's answer is the engine's own answer for the same conversation.
    messages = rows[0]["body"]["messages"]
    [direct] = llm.chat([messages], SamplingParams(max_tokens=6, temperature=0), progress=False)
    assert body["choices"][0]["message"]["content"] == direct.text
    assert body["choices"][0]["finish_reason"] == direct.finish_reason
    # The second review shares the system prompt: its leading blocks come from the prefix cache.
    assert results["bad"]["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert results["plain"]["response"]["body"]["object"] == "text_completion"

    errors = {line_of(e): e["error"] for e in read_jsonl(tmp_path / "out/errors.jsonl")}
    assert errors[4]["code"] == "invalid_request" and "context is 384 tokens" in errors[4]["message"]
    assert errors[5]["code"] == "invalid_input"

    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert summary["requests"]["done"] == 3 and summary["requests"]["failed"] == 2
    engine = summary["engine"]
    assert engine["prefill_tokens"] > 0 and engine["decode_tokens"] > 0 and engine["prefill_s"] > 0
    assert summary["tokens"]["completion"] == sum(
        r["response"]["body"]["usage"]["completion_tokens"] for r in results.values())

    # A refused request is a final error: the re-run has nothing to do.
    assert run_job(config, EmbeddedBackend(llm=llm)).status == "failed"
    assert_exactly_once(tmp_path / "out", 5)


def test_a_prompt_far_too_long_is_refused_at_validation_without_tokenizing(
    tmp_path: Path, llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2 MB line (tokenizing it would take ~10 s) is refused by its length while the input is
    checked, before any work, and the rows behind it run."""
    encode = llm.tokenizer.encode

    def encode_short(text: str, *args, **kw):  # type: ignore[no-untyped-def]
        assert len(text) < 100_000, "a huge prompt was tokenized"
        return encode(text, *args, **kw)

    monkeypatch.setattr(llm.tokenizer, "encode", encode_short)
    rows = [batch_line("huge", "word " * 400_000), batch_line("huge-text", "word " * 400_000, url="/v1/completions"),
            batch_line("fine", "The capital of France is", url="/v1/completions", max_tokens=2)]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    config = JobConfig(input=path, output=tmp_path / "out", progress=False)
    backend = EmbeddedBackend(llm=llm)
    assert run_job(config, backend).status == "failed"
    errors = {e["custom_id"]: e["error"] for e in read_jsonl(tmp_path / "out/errors.jsonl")}
    assert errors.keys() == {"huge", "huge-text"}
    for error in errors.values():
        assert error["code"] == "invalid_input"  # refused by validation, not by the run
        assert "2,000,000 characters" in error["message"] and "context of 384 tokens" in error["message"]
    assert [r["custom_id"] for r in read_jsonl(tmp_path / "out/results.jsonl")] == ["fine"]


class InterruptAfterFirst(EmbeddedBackend):
    """Sends this process a SIGINT as soon as the first result is in, like a Ctrl-C."""

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        real_result = sink.result

        def result(*args, **kw) -> None:
            real_result(*args, **kw)
            if not stop.requested:
                os.kill(os.getpid(), signal.SIGINT)

        sink.result = result  # type: ignore[method-assign]
        return super().run(requests, sink, stop)


@pytest.mark.slow
def test_ctrl_c_finishes_running_requests_drops_the_rest_and_resumes(
    tmp_path: Path, llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "docs.txt"
    path.write_text("".join(f"Review {i}: it works, mostly.\n" for i in range(10)))
    options = DocumentOptions(system="Label the review.", template="{text}", max_tokens=4, temperature=0)
    config = JobConfig(input=path, output=tmp_path / "out", options=options, progress=False)
    outcome = run_job(config, InterruptAfterFirst(llm=llm))
    assert outcome.status == "interrupted" and outcome.requests.not_done == 10 - outcome.requests.done
    assert finish(outcome, Console(stderr=True)) == ExitCode.INTERRUPTED  # what `tokenmill run` says and returns
    assert "Re-run the same command to resume" in capsys.readouterr().err
    first = [r["custom_id"] for r in read_jsonl(tmp_path / "out/results.jsonl")]
    assert 1 <= len(first) <= 4  # at most the running batch finished; the queued ones were dropped
    assert not llm.engine.has_unfinished_requests()

    assert run_job(config, EmbeddedBackend(llm=llm)).status == "done"
    assert_exactly_once(tmp_path / "out", 10)
    assert [r["custom_id"] for r in read_jsonl(tmp_path / "out/results.jsonl")][: len(first)] == first


@pytest.mark.slow
def test_length_buckets_order_runs_every_request(tmp_path: Path, llm: LLM) -> None:
    docs = ["Short.", "A much longer review that goes on about the product for a while. " * 3, "Mid-length one here."]
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(docs) + "\n")
    config = JobConfig(input=path, output=tmp_path / "out", options=DocumentOptions(max_tokens=3, temperature=0),
                       order="length-buckets", progress=False)
    backend = AdmissionSpy(llm=llm)
    assert run_job(config, backend).status == "done"
    assert backend.seen == ["line-2", "line-3", "line-1"]  # biggest first
    assert_exactly_once(tmp_path / "out", 3)


class AdmissionSpy(EmbeddedBackend):
    """Notes the order in which requests are handed to the engine."""

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        self.seen: list[str] = []

        def spied() -> Iterator[BatchRequest]:
            for request in requests:
                self.seen.append(request.custom_id)
                yield request

        return super().run(spied(), sink, stop)
