"""tokenmill/http_client.py: the session every part's calls go through (a job's endpoints and
Batch API, bench), against a server on 127.0.0.1 that records what reached it: paths under the
base URL's own, the key as a bearer token, the environment's proxy (NO_PROXY honoured)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import aiohttp
import pytest

from tokenmill.http_client import TRANSPORT_ERRORS, client_session, describe_error, env_proxy

PROXY_NAMES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy",
               "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


@pytest.fixture(autouse=True)
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_NAMES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture()
def recorder() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A server that answers every GET with `{"ok": true}` and keeps the request line's target and
    the headers it got (as a proxy, it sees the absolute URL)."""
    seen: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            seen.append({"target": self.path, **{k.lower(): v for k, v in self.headers.items()}})
            raw = json.dumps({"ok": True}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def get(base_url: str, path: str, api_key: str | None = None) -> Any:
    async def call() -> Any:
        async with client_session(base_url, aiohttp.ClientTimeout(total=10), 1, api_key) as http, \
                http.get(path) as reply:
            reply.raise_for_status()
            return await reply.json(content_type=None)

    return asyncio.run(call())


def test_paths_go_under_the_base_url_s_own_path_with_the_key(recorder: tuple[str, list[dict[str, Any]]]) -> None:
    url, seen = recorder
    assert get(f"{url}/gateway/openai/", "v1/models", api_key="k-1") == {"ok": True}
    assert get(url, "v1/batches?limit=2") == {"ok": True}
    assert [s["target"] for s in seen] == ["/gateway/openai/v1/models", "/v1/batches?limit=2"]
    assert seen[0]["authorization"] == "Bearer k-1" and "authorization" not in seen[1]


def test_the_environment_s_proxy_carries_the_calls(
    recorder: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy, seen = recorder
    monkeypatch.setenv("HTTP_PROXY", proxy)
    # No such host: only through the proxy is there an answer.
    assert get("http://api.tokenmill-test.invalid/v1", "v1/models", api_key="k") == {"ok": True}
    assert seen[0]["target"] == "http://api.tokenmill-test.invalid/v1/v1/models"
    assert seen[0]["host"] == "api.tokenmill-test.invalid"
    monkeypatch.setenv("NO_PROXY", ".tokenmill-test.invalid")
    with pytest.raises(aiohttp.ClientConnectorError):  # straight to a host that is not there
        get("http://api.tokenmill-test.invalid/v1", "v1/models")
    assert len(seen) == 1


def test_the_proxy_is_the_environment_s_except_where_no_proxy_says(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_proxy("https://api.example.com") is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.corp:3128")
    monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1,.internal")
    assert env_proxy("https://api.example.com") == "http://proxy.corp:3128"
    assert env_proxy("http://api.example.com") is None  # HTTP_PROXY is not set
    assert env_proxy("http://127.0.0.1:8000") is None
    assert env_proxy("https://gpu-1.internal:8000") is None


def test_a_call_that_got_no_reply_is_named_by_its_error() -> None:
    async def refused() -> BaseException:
        try:
            async with client_session("http://127.0.0.1:9", aiohttp.ClientTimeout(total=10), 1) as http, \
                    http.get("v1/models"):
                pass
        except TRANSPORT_ERRORS as exc:
            return exc
        raise AssertionError("port 9 answered")

    exc = asyncio.run(refused())
    assert isinstance(exc, aiohttp.ClientConnectorError)
    assert describe_error(exc).startswith("ClientConnectorError: Cannot connect to host 127.0.0.1:9")
    assert describe_error(TimeoutError()) == "TimeoutError"  # an attempt's own timeout says nothing more
