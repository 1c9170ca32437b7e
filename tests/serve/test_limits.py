"""Request bodies over the limit are a 413 before the server holds them: --max-request-bytes for
the JSON routes, --max-upload-bytes for `POST /v1/files`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest
from fastapi import FastAPI, Request

from tests.serve.conftest import MODEL, Running, serving
from tokenmill.engine.llm import LLM
from tokenmill.serve import cli
from tokenmill.serve.errors import install_handlers
from tokenmill.serve.limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_UPLOAD_BYTES, BodyLimit
from tokenmill.serve.state import ServeState

LIMIT, UPLOAD_LIMIT = 4096, 8192
CHUNK = 1000


def assert_too_large(response: httpx.Response, limit: int, flag: str) -> None:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert error["param"] is None and str(limit) in error["message"] and flag in error["message"]


# ---- the middleware, over a small app: what it lets the app read ----------------------------------
class Body:
    """A request body sent CHUNK bytes at a time, counting the chunks the server took."""

    def __init__(self, size: int) -> None:
        self.size, self.taken = size, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for start in range(0, self.size, CHUNK):
            self.taken += 1
            yield b"x" * min(CHUNK, self.size - start)


def echo_app() -> FastAPI:
    app = FastAPI()
    install_handlers(app)

    @app.post("/v1/completions")
    @app.post("/v1/files")
    async def echo(request: Request) -> dict[str, int]:
        return {"received": len(await request.body())}

    app.add_middleware(BodyLimit, max_request_bytes=LIMIT, max_upload_bytes=UPLOAD_LIMIT)
    return app


def post(path: str, body: Body, headers: dict[str, str] | None = None) -> httpx.Response:
    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(echo_app()), base_url="http://test") as client:
            return await client.post(path, content=body, headers=headers)

    return asyncio.run(send())


def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    body = Body(LIMIT * 10)
    response = post("/v1/completions", body, headers={"Content-Length": str(body.size)})
    assert_too_large(response, LIMIT, "--max-request-bytes")
    assert body.taken == 0


def test_a_chunked_body_is_cut_off_at_the_limit() -> None:
    body = Body(LIMIT * 10)  # no Content-Length: sent chunked
    assert_too_large(post("/v1/completions", body), LIMIT, "--max-request-bytes")
    assert body.taken == LIMIT // CHUNK + 1  # up to the chunk that went over, not one more


@pytest.mark.parametrize("size", [1, LIMIT])
def test_a_body_within_the_limit_reaches_the_app(size: int) -> None:
    for headers in ({}, {"Content-Length": str(size)}):
        response = post("/v1/completions", Body(size), headers)
        assert response.status_code == 200 and response.json() == {"received": size}


def test_uploads_have_their_own_limit() -> None:
    assert post("/v1/files", Body(UPLOAD_LIMIT)).json() == {"received": UPLOAD_LIMIT}  # over LIMIT: fine here
    assert_too_large(post("/v1/files", Body(UPLOAD_LIMIT * 100)), UPLOAD_LIMIT, "--max-upload-bytes")
    assert_too_large(post("/v1/completions", Body(UPLOAD_LIMIT)), LIMIT, "--max-request-bytes")


# ---- a live server -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_server(serve_llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with serving(serve_llm, tmp_path_factory.mktemp("serve-state"), max_request_bytes=LIMIT,
                 max_upload_bytes=UPLOAD_LIMIT) as running:
        yield running


def completion(prompt_bytes: int) -> dict:
    return {"model": MODEL, "prompt": "x" * prompt_bytes, "max_tokens": 1}


def test_the_server_refuses_large_bodies_and_serves_the_rest(small_server: Running) -> None:
    url = f"{small_server.v1}/completions"
    assert_too_large(httpx.post(url, json=completion(LIMIT)), LIMIT, "--max-request-bytes")
    data = json.dumps(completion(LIMIT)).encode()
    chunked = (data[i:i + CHUNK] for i in range(0, len(data), CHUNK))
    assert_too_large(httpx.post(url, content=chunked, headers={"Content-Type": "application/json"}),
                     LIMIT, "--max-request-bytes")
    client = openai.OpenAI(base_url=small_server.v1, api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=MODEL, prompt="x" * LIMIT, max_tokens=1)
    assert refused.value.status_code == 413
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=1).usage.completion_tokens == 1


def jsonl(lines: int, line_bytes: int) -> bytes:
    """`lines` JSON objects, each `line_bytes` long with its newline."""
    return (json.dumps({"pad": "y" * (line_bytes - len('{"pad": ""}\n'))}) + "\n").encode() * lines


def test_uploads_are_limited_by_their_own_flag(small_server: Running) -> None:
    def upload(data: bytes) -> httpx.Response:
        return httpx.post(f"{small_server.v1}/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})

    ok = upload(jsonl(8, UPLOAD_LIMIT // 8))  # twice --max-request-bytes, and all --max-upload-bytes allow
    assert ok.status_code == 200 and ok.json()["bytes"] == UPLOAD_LIMIT
    assert_too_large(upload(jsonl(9, UPLOAD_LIMIT // 8)), UPLOAD_LIMIT, "--max-upload-bytes")  # the file
    assert_too_large(upload(jsonl(100, UPLOAD_LIMIT // 8)), UPLOAD_LIMIT, "--max-upload-bytes")  # the body
    assert upload(jsonl(1, LIMIT + 1)).status_code == 200  # a line of LIMIT bytes, and its newline
    long_line = upload(jsonl(1, LIMIT + 2))  # one request over --max-request-bytes
    assert long_line.status_code == 400
    assert long_line.json()["error"]["message"].startswith(f"line 1: longer than {LIMIT} bytes")
    files = httpx.get(f"{small_server.v1}/files").json()["data"]
    assert len(files) == 2  # nothing kept from the refused ones
    assert not list((small_server.state.state_dir / "files").glob("*.part"))


def test_the_limits_default_alike_in_the_cli_and_the_state() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.max_request_bytes, args.max_upload_bytes, args.docs) == (
        DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_UPLOAD_BYTES, True)
    assert parser.parse_args(["--no-docs", "--max-request-bytes", "5"]).max_request_bytes == 5
    defaults = {f.name: f.default for f in dataclasses.fields(ServeState)}  # what callers that omit them get
    assert (defaults["max_request_bytes"], defaults["max_upload_bytes"], defaults["docs"]) == (
        DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_UPLOAD_BYTES, True)
    assert DEFAULT_MAX_REQUEST_BYTES == 10 * 2**20 and DEFAULT_MAX_UPLOAD_BYTES == 200 * 2**20
