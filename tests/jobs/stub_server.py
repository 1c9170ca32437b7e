"""A tiny OpenAI-compatible server on 127.0.0.1 that fails on cue, for the endpoint backend's tests.

Each request is keyed by its prompt (the last message's content, or `prompt`); `script[key]`
lists what to do on the 1st, 2nd, … attempt: "ok", "429", "429-wait" (Retry-After: 1), "500",
"slow" (reply after the client gave up), "drop" (close the connection without a reply), "400".
Attempts past the script's end are "ok". The server answers at most `max_requests` requests
(then 400s, which the client never retries) and stops with the `with` block.

An outage: `go_down(seconds)` (or `outage_after=n`: once n requests were admitted, for
`outage_s`) makes every request, POST or the breaker's GET /v1/models, a dropped connection,
counted in `down_hits` by method, as a killed server behind a proxy looks; `come_back()` ends it.
GET /v1/models answers a model list while up. `answer(body, key)`, when given, writes the reply's
text (default: "echo: KEY"), for tests that score answers; `logprobs(body, key)`, the choice's
`logprobs` for a request that asks for them (a request that does not gets none).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StubServer:
    def __init__(
        self, script: dict[str, list[str]] | None = None, delay: float = 0.0, slow_s: float = 1.0,
        max_requests: int = 500, outage_after: int | None = None, outage_s: float = 0.0,
        answer: Callable[[dict[str, Any], str], str] | None = None,
        logprobs: Callable[[dict[str, Any], str], dict[str, Any]] | None = None,
    ) -> None:
        self.script = script or {}
        self.answer, self.logprobs = answer, logprobs
        self.delay, self.slow_s, self.max_requests = delay, slow_s, max_requests
        self.outage_after, self.outage_s = outage_after, outage_s
        self.down_until = 0.0  # monotonic time the current outage ends
        self.down_hits: Counter[str] = Counter()  # requests dropped in an outage, by method
        self.attempts: Counter[str] = Counter()
        self.times: dict[str, list[float]] = {}  # key → arrival time of each attempt
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.inflight = self.max_inflight = 0
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = False
        self._server.block_on_close = True  # server_close() waits for slow handlers: nothing outlives a test
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> StubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def go_down(self, seconds: float = math.inf) -> None:
        self.down_until = time.monotonic() + seconds

    def come_back(self) -> None:
        self.down_until = 0.0

    def is_down(self, method: str) -> bool:
        """Whether to drop this request (counting it) because the server is "down"."""
        with self._lock:
            if time.monotonic() >= self.down_until:
                return False
            self.down_hits[method] += 1
            return True

    def admit(self, key: str, body: dict[str, Any], headers: dict[str, str]) -> str:
        """Record an attempt and say what to do with it."""
        with self._lock:
            if sum(self.attempts.values()) >= self.max_requests:
                return "400"
            self.attempts[key] += 1
            if sum(self.attempts.values()) == self.outage_after:  # this one is answered, the next are not
                self.go_down(self.outage_s)
            self.times.setdefault(key, []).append(time.monotonic())
            self.bodies.append(body)
            self.headers.append(headers)
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            steps = self.script.get(key, [])
            n = self.attempts[key]
            return steps[n - 1] if n <= len(steps) else "ok"

    def done(self) -> None:
        with self._lock:
            self.inflight -= 1


def completion(body: dict[str, Any], key: str, text: str | None = None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    words = len(key.split())
    text = f"echo: {key}" if text is None else text
    if "messages" in body:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": "stop"}
        kind = "text_completion"
    if logprobs is not None:
        choice["logprobs"] = logprobs
    usage = {"prompt_tokens": words + 5, "completion_tokens": words + 1, "total_tokens": 2 * words + 6,
             "prompt_tokens_details": {"cached_tokens": 2}}
    return {"id": "cmpl-stub", "object": kind, "created": 0, "model": body.get("model", "stub"),
            "choices": [choice], "usage": usage}


def _key(body: dict[str, Any]) -> str:
    if "messages" in body:
        return str(body["messages"][-1]["content"])
    return str(body.get("prompt"))


class _Server(ThreadingHTTPServer):
    # socketserver's default listen backlog is 5: a client opening 16+ connections at once has the
    # rest of its SYNs dropped and retried a second later (TCP's initial retransmit timeout).
    request_queue_size = 1024


def _handler(stub: StubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            if stub.is_down("GET"):
                self.close_connection = True
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]}, {})
            else:
                self._send(404, {"error": {"message": f"no {self.path}"}}, {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if stub.is_down("POST"):
                self.close_connection = True  # closed with no reply
                return
            key = _key(body)
            action = stub.admit(key, body, dict(self.headers))
            try:
                time.sleep(stub.delay)
                self._act(action, body, key)
            finally:
                stub.done()

        def _act(self, action: str, body: dict[str, Any], key: str) -> None:
            if action == "drop":
                self.close_connection = True  # closed with no reply: the client sees a dropped connection
                return
            if action == "slow":
                time.sleep(stub.slow_s)
            status, headers = {"429": (429, {"Retry-After": "0"}), "429-wait": (429, {"Retry-After": "1"}),
                               "500": (500, {}), "400": (400, {})}.get(action, (200, {}))
            text = stub.answer(body, key) if stub.answer else None
            logprobs = stub.logprobs(body, key) if stub.logprobs and body.get("logprobs") else None
            refusal = {"error": {"message": f"stub says {action}"}}
            reply = completion(body, key, text, logprobs) if status == 200 else refusal
            self._send(status, reply, headers)

        def _send(self, status: int, reply: dict[str, Any], headers: dict[str, str]) -> None:
            data = json.dumps(reply).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client gave up on a slow reply

    return Handler
