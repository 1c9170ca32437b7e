"""The endpoint target's client against a stub that streams on cue: token times are when each SSE
chunk arrives (not when the reply ends), --timeout bounds a stream's silence (not its length), a
line of any length is read, the environment's proxy carries the calls, and a request the network
fails is a failed record named by aiohttp's error, the run going on."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import aiohttp
import pytest

from tokenmill.bench.endpoint import EndpointTarget
from tokenmill.bench.runner import environment
from tokenmill.bench.workloads import Request

PAUSE_S = 0.5  # between the first token and the rest
LONG_TEXT = "x" * 2_000_000  # one token's text, on one line: more than aiohttp's own line reader takes


@pytest.fixture(autouse=True)
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stub is on 127.0.0.1: no proxy from the environment may carry the calls elsewhere."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy",
                 "no_proxy"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def stub() -> Iterator[tuple[str, list[str]]]:
    """(its URL, the target of each request's line: a proxy's is the absolute URL.) GET: the
    models. POST /v1/completions by prompt: "pause" streams a token, waits PAUSE_S, streams three
    more and the usage; "steady" streams seven tokens PAUSE_S / 5 apart; "long" streams one token
    of LONG_TEXT; "cut" promises more bytes than it sends and closes; "busy" is a 503."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            seen.append(self.path)
            self._reply(200, json.dumps({"data": [{"id": "stub-model"}]}).encode())

        def do_POST(self) -> None:
            seen.append(self.path)
            prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
            if prompt == "busy":
                self._reply(503, b"overloaded")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            if prompt == "cut":
                self.send_header("Content-Length", "100000")
            self.end_headers()
            self._event({"choices": [{"index": 0, "text": LONG_TEXT if prompt == "long" else " a"}]})
            if prompt == "cut":
                return  # the connection closes short of the length promised
            pauses = {"pause": [PAUSE_S, 0, 0], "steady": [PAUSE_S / 5] * 6}.get(prompt, [])
            for pause in pauses:
                time.sleep(pause)
                self._event({"choices": [{"index": 0, "text": " b"}]})
            self._event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}})
            self.wfile.write(b"data: [DONE]\n\n")

        def _event(self, obj: dict[str, Any]) -> None:
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        def _reply(self, status: int, raw: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    finally:
        server.shutdown()
        server.server_close()


def test_token_times_are_when_each_chunk_arrives(stub: tuple[str, list[str]]) -> None:
    target = EndpointTarget(stub[0], tokenizer=None)
    assert target.model == "stub-model"  # asked of GET /v1/models
    [rec] = target.run([Request(None, "pause", 5, 4)], batch_size=1).records
    assert rec.ok and (rec.input_tokens, rec.output_tokens) == (5, 4)
    assert len(rec.token_times) == 4 and rec.token_times[0] == rec.first_token
    gap = rec.token_times[1] - rec.token_times[0]
    assert gap >= PAUSE_S * 0.9  # the first token was timed before the pause, not with the rest
    assert rec.first_token - rec.start < gap and rec.end >= rec.token_times[-1]


def test_the_timeout_bounds_a_stream_s_silence_not_its_length(stub: tuple[str, list[str]]) -> None:
    target = EndpointTarget(stub[0], tokenizer=None, model="stub-model", timeout_s=PAUSE_S * 0.6)
    steady, paused = target.run([Request(None, "steady", 5, 4), Request(None, "pause", 5, 4)], batch_size=2).records
    assert steady.error is None and len(steady.token_times) == 7
    assert steady.end - steady.start > 1.5 * target.timeout.sock_read  # 6 gaps, each well short of it
    assert paused.error is not None and paused.error.startswith("SocketTimeoutError")
    assert issubclass(aiohttp.SocketTimeoutError, TimeoutError)
    assert len(paused.token_times) == 1  # what came before the silence was timed


def test_a_line_longer_than_aiohttp_reads_at_once_is_one_token(stub: tuple[str, list[str]]) -> None:
    target = EndpointTarget(stub[0], tokenizer=None, model="stub-model")
    [rec] = target.run([Request(None, "long", 5, 1)], batch_size=1).records
    assert rec.error is None and len(rec.token_times) == 1 and rec.output_tokens == 4  # the stub's usage


def test_a_failed_request_is_a_failed_record_and_the_run_goes_on(stub: tuple[str, list[str]]) -> None:
    target = EndpointTarget(stub[0], tokenizer=None, model="stub-model")
    requests = [Request(None, prompt, 5, 4) for prompt in ("cut", "busy", "pause")]
    cut, busy, fine = target.run(requests, batch_size=3).records
    assert cut.error is not None and issubclass(getattr(aiohttp, cut.error.split(":")[0]), aiohttp.ClientError)
    assert busy.error == "HTTP 503: b'overloaded'"
    assert fine.ok


def test_the_environment_s_proxy_carries_the_calls(
    stub: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, seen = stub
    monkeypatch.setenv("HTTP_PROXY", url.removesuffix("/v1"))
    del seen[:]
    # No such host: only through the proxy is there an answer.
    target = EndpointTarget("http://bench.tokenmill-test.invalid/v1", tokenizer=None)
    [rec] = target.run([Request(None, "steady", 5, 4)], batch_size=1).records
    assert target.model == "stub-model" and rec.ok
    assert seen == ["http://bench.tokenmill-test.invalid/v1/models", "http://bench.tokenmill-test.invalid/v1/completions"]


def test_the_environment_names_the_http_client() -> None:
    assert environment()["aiohttp"] == aiohttp.__version__
