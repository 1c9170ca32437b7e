"""--api-key: every route but /health needs `Authorization: Bearer KEY`, the docs included; --no-docs."""

from __future__ import annotations

import io
import socket
import urllib.parse

import httpx
import openai
import pytest

from tests.serve.conftest import MODEL, serving


def test_api_key_required(serve_llm, tmp_path) -> None:
    with serving(serve_llm, tmp_path, api_key="s3cret") as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for path in ("/v1/models", "/metrics", "/v1/batches"):
                response = httpx.get(f"{server.url}{path}", headers=headers)
                assert response.status_code == 401, (path, headers)
                assert response.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=server.v1, api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="Hello", max_tokens=1).usage.completion_tokens == 1


DECLARED_BYTES = 8 * 2**20  # what the request says its body is: within both limits (limits.py)
ANSWER_WAIT_S = 5  # the rest of the body never comes: without an answer by then, the server is waiting for it
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi"}}\n'
# The start of each body, well formed: an upload's first part and lines, a JSON body's first field.
UPLOAD_START = (
    b'--b\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
    b"Content-Type: application/octet-stream\r\n\r\n" + LINE * 500
)
JSON_START = b'{"model": "m", "prompt": "' + b"x" * 40_000


def send_headers_then_wait(url: str, path: str, headers: dict[str, str], start: bytes) -> bytes:
    """Send a request's headers and the `start` of a DECLARED_BYTES body, then read the answer."""
    where = urllib.parse.urlsplit(url)
    lines = [f"POST {path} HTTP/1.1", f"Host: {where.netloc}", f"Content-Length: {DECLARED_BYTES}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    with socket.create_connection((where.hostname, where.port), timeout=ANSWER_WAIT_S) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + start)
        answer = b""
        try:
            while not answer.endswith(b"}"):  # the end of the error's JSON body
                if not (chunk := sock.recv(65536)):
                    break
                answer += chunk
        except TimeoutError:
            answer += b"(no more answer: the server is reading the body)"
        return answer


@pytest.mark.parametrize(
    ("path", "content_type", "start"),
    [
        ("/v1/files", "multipart/form-data; boundary=b", UPLOAD_START),
        ("/v1/completions", "application/json", JSON_START),
    ],
)
def test_a_request_without_the_key_is_refused_before_its_body_is_read(
    serve_llm, tmp_path, path: str, content_type: str, start: bytes
) -> None:
    """The 401 comes as soon as the headers are in, not once the server has read the body (an
    upload: written it to disk)."""
    with serving(serve_llm, tmp_path, api_key="s3cret") as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            answer = send_headers_then_wait(server.url, path, {"Content-Type": content_type, **headers}, start)
            assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
            assert b'"invalid_api_key"' in answer
        assert not list((tmp_path / "files").iterdir())  # nothing of it stored
        good = openai.OpenAI(base_url=server.v1, api_key="s3cret", max_retries=0)
        assert good.files.create(file=("in.jsonl", io.BytesIO(LINE)), purpose="batch").bytes == len(LINE)


DOCS = ("/docs", "/redoc", "/openapi.json")


def test_the_api_key_covers_the_docs(serve_llm, tmp_path) -> None:
    with serving(serve_llm, tmp_path, api_key="s3cret") as server:
        for path in DOCS:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                response = httpx.get(f"{server.url}{path}", headers=headers)
                assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key", path
            assert httpx.get(f"{server.url}{path}", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        description = httpx.get(f"{server.url}/openapi.json", headers={"Authorization": "Bearer s3cret"}).json()
    # The description says so: a bearer key on every operation but /health, and their 401s.
    assert description["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert description["security"] == [{"bearer": []}]
    health = description["paths"].pop("/health")["get"]
    assert health["security"] == [] and "401" not in health["responses"]
    for path, operations in description["paths"].items():
        for method, operation in operations.items():
            assert "401" in operation["responses"] and "security" not in operation, (method, path)


def test_no_docs(serve_llm, tmp_path) -> None:
    with serving(serve_llm, tmp_path, docs=False) as server:
        for path in DOCS:
            assert httpx.get(f"{server.url}{path}").status_code == 404, path
        assert httpx.get(f"{server.v1}/models").status_code == 200
