"""The Batch API end to end with the `openai` client, including a server restart mid-batch; the
files behind it: uploads checked as they are copied in, listed, deleted."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve.conftest import MODEL, serving
from tokenmill.serve.batches import FileStore
from tokenmill.serve.errors import APIError


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
        with pytest.raises(openai.ConflictError, match=batch.id):  # a running batch's input stays
            client.files.delete(big.id)
        assert client.batches.cancel(batch.id).status == "cancelling"
        cancelled = wait_for(client, batch.id, lambda b: b.status == "cancelled")
        assert 1 <= cancelled.request_counts.completed < 24
        assert client.files.delete(big.id).deleted

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


def upload(server, data: bytes, purpose: str = "batch") -> httpx.Response:
    return httpx.post(f"{server.v1}/files", files={"file": ("in.jsonl", data)}, data={"purpose": purpose})


def test_an_upload_must_be_jsonl(serve_llm, tmp_path: Path) -> None:
    good = json.dumps({"custom_id": "a"}).encode() + b"\n"
    refused = {
        b"\x89PNG\r\n\x1a\n\x00\x00": "line 1: not UTF-8",
        good + b'{"custom_id": "\xff"}\n': "line 2: not UTF-8",
        good + b"\n" + b"{not json}\n": "line 3: not JSON (Expecting property name enclosed in double quotes",
        good + b"[1, 2]\n": "line 2: expected a JSON object, got a list",
        b"\n \n": "the file has no requests",
    }
    with serving(serve_llm, tmp_path) as server:
        for data, message in refused.items():
            response = upload(server, data)
            assert response.status_code == 400, data
            error = response.json()["error"]
            assert error["message"].startswith(message) and error["param"] == "file", (data, error)
        assert upload(server, good, purpose="fine-tune").json()["error"]["param"] == "purpose"
        assert httpx.get(f"{server.v1}/files").json()["data"] == []
        ok = upload(server, b"\xef\xbb\xbf" + good + b"\n" + good.rstrip())  # a BOM, a blank line, no last newline
        assert ok.status_code == 200
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == sorted(
        [f"{ok.json()['id']}.json", f"{ok.json()['id']}.jsonl"])  # nothing of the refused ones


def test_an_upload_is_copied_in_pieces(serve_llm, tmp_path: Path, monkeypatch) -> None:
    """Never read whole: Starlette spools it to a temporary file, the server copies it a line at a time."""
    from starlette.datastructures import UploadFile

    def read_whole(*_, **__):
        raise AssertionError("the upload was read into memory")

    monkeypatch.setattr(UploadFile, "read", read_whole)
    data = batch_file(2000, bad=False)  # ~400 kB
    with serving(serve_llm, tmp_path) as server:
        client = client_for(server)
        uploaded = client.files.create(file=("big.jsonl", io.BytesIO(data)), purpose="batch")
        assert client.files.content(uploaded.id).content == data


def test_files_are_listed_and_deleted(serve_llm, tmp_path: Path) -> None:
    with serving(serve_llm, tmp_path) as server:
        client = client_for(server)
        first = client.files.create(file=("a.jsonl", io.BytesIO(batch_file(1))), purpose="batch")
        second = client.files.create(file=("b.jsonl", io.BytesIO(batch_file(2))), purpose="batch")
        listed = httpx.get(f"{server.v1}/files").json()
        assert listed["object"] == "list" and listed["has_more"] is False
        assert {f["id"] for f in listed["data"]} == {first.id, second.id}
        assert [f.id for f in client.files.list(purpose="batch")] == [f["id"] for f in listed["data"]]
        assert client.files.list(purpose="batch_output").data == []

        deleted = client.files.delete(first.id)
        assert (deleted.id, deleted.object, deleted.deleted) == (first.id, "file", True)
        assert [f.id for f in client.files.list()] == [second.id]
        for gone in (lambda: client.files.retrieve(first.id), lambda: client.files.content(first.id),
                     lambda: client.files.delete(first.id), lambda: client.files.delete("file-nope")):
            with pytest.raises(openai.NotFoundError):
                gone()
        assert not (tmp_path / "files" / f"{first.id}.jsonl").exists()


def test_ids_are_never_paths(serve_llm, tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"_path": str(tmp_path / "secret.json"), "purpose": "batch"}))
    with pytest.raises(APIError) as refused:
        FileStore(tmp_path).delete("../secret")
    assert refused.value.status == 404 and secret.exists()
    with serving(serve_llm, tmp_path) as server:
        for method, path in (("DELETE", "files/.."), ("DELETE", "files/..%2Fsecret"), ("GET", "files/..%2Fsecret"),
                             ("GET", f"files/{'é' * 200}"), ("DELETE", f"files/{'é' * 200}"),
                             ("GET", f"batches/{'é' * 200}"), ("POST", f"batches/{'é' * 200}/cancel")):
            assert httpx.request(method, f"{server.v1}/{path}").status_code == 404, (method, path)
    assert secret.exists()
