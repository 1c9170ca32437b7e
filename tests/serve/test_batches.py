"""The Batch API end to end with the `openai` client, including a server restart mid-batch and a
batch that outlives its completion window; the files behind it: uploads checked as they are
copied in, listed, deleted, expired."""

from __future__ import annotations

import io
import json
import time
import urllib.parse
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


def jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()] if file_id else []


def summed_usage(rows: list[dict]) -> dict:
    """OpenAI's batch `usage`, added up from the output rows' response bodies."""
    usages = [row["response"]["body"]["usage"] for row in rows]
    prompt, completion = sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages)
    return {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
            "input_tokens_details": {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)},
            "output_tokens_details": {"reasoning_tokens": 0}}


class Clock:
    """The server's clock, which a test moves forward (a day in an instant)."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.time() + self.ahead


DAY = 24 * 3600
OPENAI_ERROR_ROW = {"id", "custom_id", "response", "error"}
EXPIRED = {"code": "batch_expired",  # OpenAI's
           "message": "This request could not be executed before the completion window expired."}


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
        assert done.expires_at == done.created_at + DAY and done.expired_at is None and done.model == MODEL
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
    # OpenAI's error row exactly: the input line leads the message instead of being a field of its own.
    assert set(errors[0]) == OPENAI_ERROR_ROW and errors[0]["error"]["message"].startswith(f"line {lines + 1}: ")
    assert done.usage.model_dump() == summed_usage(results)  # every result's tokens, the restart's included
    assert done.usage.output_tokens == sum(2 + 2 * i for i in range(lines))


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
        assert [(e.line, e.code) for e in failed.errors.data] == [(1, "invalid_input"), (2, "invalid_input")]
        assert "endpoint" in failed.errors.data[0].message and failed.failed_at and failed.usage is None
        try:
            client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
            raise AssertionError("expected a 404")
        except openai.NotFoundError:
            pass


def test_a_batch_past_its_completion_window_expires_keeping_what_is_done(serve_llm, tmp_path: Path) -> None:
    """The running batch stops at its deadline: its finished rows stay in the output file, each
    unfinished request gets one `batch_expired` error row. A batch queued behind it, whose window
    closed before it could start, expires without running anything."""
    short, long_ = 4, 3
    rows = [{"custom_id": f"short-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": MODEL, "prompt": f"Item {i}", "max_tokens": 2, "ignore_eos": True}}
            for i in range(short)]
    rows += [{"custom_id": f"long-{i}", "method": "POST", "url": "/v1/completions",  # minutes on this CPU
              "body": {"model": MODEL, "prompt": f"Story {i}", "max_tokens": 400, "ignore_eos": True}}
             for i in range(long_)]
    rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 2}})
    clock = Clock()
    with serving(serve_llm, tmp_path, clock=clock) as server:
        client = client_for(server)
        data = io.BytesIO(b"".join(json.dumps(r).encode() + b"\n" for r in rows))
        running = client.batches.create(input_file_id=client.files.create(file=("a.jsonl", data), purpose="batch").id,
                                        endpoint="/v1/completions", completion_window="24h")
        queued_input = client.files.create(file=("b.jsonl", io.BytesIO(batch_file(2, bad=False))), purpose="batch")
        queued = client.batches.create(input_file_id=queued_input.id, endpoint="/v1/completions",
                                       completion_window="24h")
        wait_for(client, running.id, lambda b: b.request_counts.completed == short)
        assert client.batches.retrieve(queued.id).status == "validating"  # one batch runs at a time
        clock.ahead = DAY
        expired = wait_for(client, running.id, lambda b: b.status == "expired", timeout=10)
        late = wait_for(client, queued.id, lambda b: b.status == "expired", timeout=10)
        results, errors = jsonl(client, expired.output_file_id), jsonl(client, expired.error_file_id)
        late_errors = jsonl(client, late.error_file_id)
        # The long requests were aborted, not left running (the engine thread takes the aborts from
        # its queue a moment after the batch has ended).
        deadline = time.monotonic() + 5
        while server.state.loop.snapshot.num_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.state.loop.snapshot.num_running == 0

    assert expired.expired_at >= expired.expires_at == expired.created_at + DAY
    assert expired.completed_at is None and expired.model == MODEL
    assert (expired.request_counts.total, expired.request_counts.completed, expired.request_counts.failed) == (
        short + long_ + 1, short, long_ + 1)
    assert sorted(r["custom_id"] for r in results) == [f"short-{i}" for i in range(short)]
    assert all(set(e) == OPENAI_ERROR_ROW for e in errors + late_errors)
    by_id = {e["custom_id"]: e for e in errors}
    assert len(by_id) == len(errors) == long_ + 1  # one row each, nothing twice
    for i in range(long_):
        assert by_id[f"long-{i}"]["response"] is None
        assert by_id[f"long-{i}"]["error"] == EXPIRED
    assert by_id["bad"]["error"]["code"] == "invalid_input"
    assert by_id["bad"]["error"]["message"].startswith(f"line {len(rows)}: ")
    assert expired.usage.model_dump() == summed_usage(results) and expired.usage.output_tokens == 2 * short

    assert late.in_progress_at is None and late.output_file_id is None and late.request_counts.completed == 0
    assert sorted(e["custom_id"] for e in late_errors) == ["r-0", "r-1"]
    assert all(e["error"] == EXPIRED for e in late_errors)
    assert late.usage.total_tokens == 0


def test_output_files_expire_as_asked(serve_llm, tmp_path: Path) -> None:
    clock = Clock()
    with serving(serve_llm, tmp_path, clock=clock) as server:
        client = client_for(server)
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(batch_file(2))), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h",
                                      output_expires_after={"anchor": "created_at", "seconds": 3600})
        assert batch.output_expires_after == {"anchor": "created_at", "seconds": 3600}
        done = wait_for(client, batch.id, lambda b: b.status == "completed")
        outputs = [client.files.retrieve(done.output_file_id), client.files.retrieve(done.error_file_id)]
        assert [f.expires_at - f.created_at for f in outputs] == [3600, 3600]
        assert client.files.retrieve(uploaded.id).expires_at is None  # an upload stays

        clock.ahead = 3600
        assert {f.id for f in client.files.list()} == {uploaded.id}
        for output in outputs:
            with pytest.raises(openai.NotFoundError):
                client.files.content(output.id)
        assert jsonl(client, uploaded.id)  # still there


def test_a_bad_batch_option_is_a_400_naming_it(serve_llm, tmp_path: Path) -> None:
    refused = [
        ("output_expires_after", {"anchor": "last_active_at", "seconds": 3600},
         "output_expires_after.anchor must be 'created_at', got 'last_active_at'"),
        ("output_expires_after", {"anchor": "created_at", "seconds": 3599},
         "output_expires_after.seconds must be an integer from 3600 (1 hour) to 2592000 (30 days), got 3599"),
        ("output_expires_after", {"anchor": "created_at", "seconds": 2592001}, "output_expires_after.seconds must be"),
        ("output_expires_after", {"anchor": "created_at", "seconds": "3600"}, "output_expires_after.seconds: "),
        ("output_expires_after", {"anchor": "created_at"}, "output_expires_after.seconds: Field required"),
        ("completion_window", "48h", "completion_window must be one of ['24h'], got '48h'"),
    ]
    with serving(serve_llm, tmp_path) as server:
        file_id = upload(server, batch_file(1, bad=False)).json()["id"]
        for field, value, message in refused:
            body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h", field: value}
            response = httpx.post(f"{server.v1}/batches", json=body)
            assert response.status_code == 400, (field, value)
            error = response.json()["error"]
            assert error["param"] == field and error["message"].startswith(message), error
        assert httpx.get(f"{server.v1}/batches").json()["data"] == []  # none was created


def test_batch_metadata_is_held_to_openais_limits(serve_llm, tmp_path: Path) -> None:
    """16 keys at most, each of at most 64 characters, each value a string of at most 512 (OpenAI's
    limits): the object is stored, rewritten at every status change and listed, so it stays small."""
    most = {f"key-{i:02}-".ljust(64, "k"): "v" * 512 for i in range(16)}  # every limit, just reached
    refused = [
        ({**most, "one-more": "v"}, "metadata: at most 16 keys, got 17"),
        ({"k" * 65: "v"}, f"metadata.{'k' * 65}: a key of 65 characters; at most 64"),
        ({"a key": "v" * 513}, 'metadata["a key"]: a value of 513 characters; at most 512'),
        ({"run": 5}, "metadata.run: Input should be a valid string"),
        ({"run": "a\udfffb"}, "body.metadata.run holds a lone surrogate"),
    ]
    with serving(serve_llm, tmp_path) as server:
        file_id = upload(server, batch_file(1, bad=False)).json()["id"]
        body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
        for metadata, message in refused:
            response = httpx.post(f"{server.v1}/batches", content=json.dumps({**body, "metadata": metadata}),
                                  headers={"Content-Type": "application/json"})
            assert response.status_code == 400, (message, response.text)
            error = response.json()["error"]
            assert error["param"] == "metadata" and error["message"].startswith(message), error
        assert httpx.get(f"{server.v1}/batches").json()["data"] == []  # none was created
        created = httpx.post(f"{server.v1}/batches", json={**body, "metadata": most})
        assert created.status_code == 200 and created.json()["metadata"] == most
        assert httpx.get(f"{server.v1}/batches/{created.json()['id']}").json()["metadata"] == most


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


def test_ids_are_taken_exactly_as_the_server_made_them(serve_llm, tmp_path: Path) -> None:
    """A file id with a path part (or any other spelling) named the real file to one lookup and was
    stored raw: the batch's input could then be deleted under it. Now every route, and a batch's
    input_file_id, takes only the id as the server made it."""
    with serving(serve_llm, tmp_path) as server:
        client = client_for(server)
        real = client.files.create(file=("in.jsonl", io.BytesIO(batch_file(1, bad=False))), purpose="batch").id
        not_file_ids = [f"x/{real}", f"../files/{real}", real.upper(), f" {real}"]
        unknown_ids = [f"{real}.json", f"{real}\n", real[:-1], f"{real}0", "file-nope", f"{real}/../{real}"]
        for spelling in not_file_ids + unknown_ids:
            refused = httpx.post(f"{server.v1}/batches", json={
                "input_file_id": spelling, "endpoint": "/v1/completions", "completion_window": "24h"})
            if spelling in not_file_ids:
                assert refused.status_code == 400, spelling
                assert refused.json()["error"] == {
                    "message": f"Invalid 'input_file_id': {spelling!r}. Expected an ID that begins with 'file-' "
                               "('file-' and 24 lowercase hex digits, as POST /v1/files returns it)",
                    "type": "invalid_request_error", "param": "input_file_id", "code": "invalid_value"}, spelling
            else:  # could be a file id, but is not one this server made: unknown
                assert refused.status_code == 404, spelling
                assert refused.json()["error"]["code"] == "file_not_found", spelling
            quoted = f"{server.v1}/files/{urllib.parse.quote(spelling, safe='')}"
            for method in ("GET", "DELETE"):
                gone = httpx.request(method, quoted)
                assert gone.status_code == 404, (method, spelling)
                assert set(gone.json()["error"]) == {"message", "type", "param", "code"}  # OpenAI's shape
        assert client.batches.list().data == []  # none was made on a look-alike
        assert client.files.retrieve(real).id == real  # and the real file is untouched

        batch = client.batches.create(input_file_id=real, endpoint="/v1/completions", completion_window="24h")
        for spelling in (f"x/{batch.id}", batch.id.upper(), f"{batch.id}.json"):
            path = urllib.parse.quote(spelling, safe="")
            assert httpx.get(f"{server.v1}/batches/{path}").status_code == 404, spelling
            assert httpx.post(f"{server.v1}/batches/{path}/cancel").status_code == 404, spelling
        assert client.batches.retrieve(batch.id).input_file_id == real
