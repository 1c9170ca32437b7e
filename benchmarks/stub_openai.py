"""A one-file OpenAI-compatible stub that answers at once: the far end for job-layer benchmarks.

    .venv/bin/python benchmarks/stub_openai.py --port 8123

A raw ASGI app (no framework, so the stub costs as little CPU as an HTTP server can) served by
uvicorn in one process, access log off, backlog 2048, httptools' parser when it is installed
(h11, uvicorn's default, otherwise). It answers:

  POST /v1/chat/completions, /v1/completions   a small valid completion, at once (no model, no delay)
  GET  /v1/models                              one model, "stub-model"
  GET  /health                                 200
  GET  /stats                                  {"requests": POSTs answered, "first_request_at": time.time()
                                               of the first POST or null, "last_request_at", "pid", "http"}
  POST /stats/reset                            zero the counters (a benchmark's next run starts clean)

Every completion says usage.prompt_tokens = request bytes / 4 (the body is not parsed: reading
it is all the work the stub does) and 4 completion tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

MODEL = "stub-model"
COMPLETION_TOKENS = 4


class Stats:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests = 0
        self.first_request_at: float | None = None
        self.last_request_at: float | None = None

    def to_json(self) -> bytes:
        return json.dumps({"requests": self.requests, "first_request_at": self.first_request_at,
                           "last_request_at": self.last_request_at, "pid": os.getpid(), "http": HTTP}).encode()


# uvicorn's HTTP parser: httptools when it is installed (faster), else h11 (uvicorn's pure-Python default).
HTTP = "httptools" if importlib.util.find_spec("httptools") else "h11"
STATS = Stats()
JSON_HEADERS = [(b"content-type", b"application/json")]
MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                 "owned_by": "stub"}]}).encode()
# Filled with %-formatting: id number, created, prompt tokens, total tokens.
CHAT = (b'{"id":"chatcmpl-stub%d","object":"chat.completion","created":%d,"model":"' + MODEL.encode()
        + b'","choices":[{"index":0,"message":{"role":"assistant","content":"ok, a stub reply"},'
        b'"logprobs":null,"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":%d,"completion_tokens":' + str(COMPLETION_TOKENS).encode()
        + b',"total_tokens":%d}}')
TEXT = (b'{"id":"cmpl-stub%d","object":"text_completion","created":%d,"model":"' + MODEL.encode()
        + b'","choices":[{"index":0,"text":" ok, a stub reply","logprobs":null,"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":%d,"completion_tokens":' + str(COMPLETION_TOKENS).encode()
        + b',"total_tokens":%d}}')
COMPLETIONS = {"/v1/chat/completions": CHAT, "/v1/completions": TEXT}


async def read_body(receive) -> int:
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            return size


async def respond(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": body})


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":  # lifespan is off; anything else is not ours
        return
    method, path = scope["method"], scope["path"]
    if method == "POST" and path in COMPLETIONS:
        size = await read_body(receive)
        now = time.time()
        STATS.requests += 1
        if STATS.first_request_at is None:
            STATS.first_request_at = now
        STATS.last_request_at = now
        prompt = size // 4
        body = COMPLETIONS[path] % (STATS.requests, int(now), prompt, prompt + COMPLETION_TOKENS)
        await respond(send, 200, body)
    elif method == "GET" and path == "/v1/models":
        await respond(send, 200, MODELS)
    elif method == "GET" and path == "/health":
        await respond(send, 200, b"{}")
    elif method == "GET" and path == "/stats":
        await respond(send, 200, STATS.to_json())
    elif method == "POST" and path == "/stats/reset":
        await read_body(receive)
        STATS.reset()
        await respond(send, 200, STATS.to_json())
    else:
        await read_body(receive)
        await respond(send, 404, b'{"error":{"message":"not found","type":"invalid_request_error","code":null}}')


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, http=HTTP, access_log=False, log_level="warning",
                lifespan="off", backlog=2048)


if __name__ == "__main__":
    main()
