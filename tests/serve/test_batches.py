"""The Batch API end to end with the `openai` client, including a server restart mid-batch."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import openai

from tests.serve.conftest import MODEL, serving


def batch_file(lines: int, bad: bool = True) -> bytes:
    rows = [{"custom_id": f"r-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": MODEL, "prompt": f"Item {i}: a short story about a cat", "temperature": 0,
                      "max_tokens": 2 + 2 * i, "ignore_eos": True}}  # staggered: results trickle in
            for i in range(lines)]
    if bad:
        rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                     "body": {"model": MODEL, "prompt": "x", "max_tokens": 0}})
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def wait_for(client: openai.OpenAI, batch_id: str, done, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"timed out: {batch}")


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def test_batch_round_trip_across_a_restart(serve_llm, tmp_path: Path) -> None:
    lines = 16
    with serving(serve_llm, tmp_path) as server:
        client = client_for(server)
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(batch_file(lines))), purpose="batch")
        assert client.files.retrieve(uploaded.id).bytes == len(batch_file(lines))
        assert client.files.content(uploaded.id).content == batch_file(lines)
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                      completion_window="24h", metadata={"run": "test"})
        assert batch.status == "validating" and batch.metadata == {"run": "test"}
        mid = wait_for(client, batch.id, lambda b: b.status == "in_progress" and b.request_counts.completed >= 3)
        assert mid.request_counts.total == lines + 1 and mid.request_counts.failed == 1  # the bad line
    # The server went away mid-batch: on disk the batch is still in progress, with partial results.
    on_disk = json.loads((tmp_path / "batches" / f"{batch.id}.json").read_text())
    assert on_disk["status"] == "in_progress"
    partial = (tmp_path / "batches" / batch.id / "results.jsonl").read_text().splitlines()
    assert 3 <= len(partial) < lines

    with serving(serve_llm, tmp_path) as server:
        client = client_for(server)
        done = wait_for(client, batch.id, lambda b: b.status not in ("validating", "in_progress", "finalizing"))
        assert done.status == "completed", done
        assert done.request_counts.completed == lines and done.request_counts.failed == 1
        assert done.in_progress_at and done.finalizing_at and done.completed_at
        results = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
        errors = [json.loads(line) for line in client.files.content(done.error_file_id).text.splitlines()]
        assert [b.id for b in client.batches.list().data] == [batch.id]
    assert sorted(r["custom_id"] for r in results) == sorted(f"r-{i}" for i in range(lines))  # each exactly once
    assert results[: len(partial)] == [json.loads(line) for line in partial]  # kept, not redone
    for row in results:
        body = row["response"]["body"]
        i = int(row["custom_id"][2:])
        assert row["response"]["status_code"] == 200 and body["model"] == MODEL
        assert body["usage"]["completion_tokens"] == 2 + 2 * i and body["choices"][0]["finish_reason"] == "length"
    assert [e["custom_id"] for e in errors] == ["bad"] and "max_tokens" in errors[0]["error"]["message"]


def test_cancel_and_failed_batches(serve_llm, tmp_path: Path) -> None:
    with serving(serve_llm, tmp_path) as server:
        client = client_for(server)
        big = client.files.create(file=("big.jsonl", io.BytesIO(batch_file(24, bad=False))), purpose="batch")
        batch = client.batches.create(input_file_id=big.id, endpoint="/v1/completions", completion_window="24h")
        wait_for(client, batch.id, lambda b: b.request_counts.completed >= 1)
        assert client.batches.cancel(batch.id).status == "cancelling"
        cancelled = wait_for(client, batch.id, lambda b: b.status == "cancelled")
        assert 1 <= cancelled.request_counts.completed < 24

        wrong = client.files.create(file=("c.jsonl", io.BytesIO(batch_file(2, bad=False))), purpose="batch")
        failed = client.batches.create(input_file_id=wrong.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
        failed = wait_for(client, failed.id, lambda b: b.status == "failed")
        assert "endpoint" in failed.errors.data[0].message
        try:
            client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
            raise AssertionError("expected a 404")
        except openai.NotFoundError:
            pass
