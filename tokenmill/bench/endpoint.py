"""Any OpenAI-compatible endpoint as a bench target, measured at the client.

Requests go to `/v1/completions` with `stream: true` and `stream_options.include_usage`, so
TTFT and inter-token gaps are what a caller sees (network and server queueing included) and the
token counts are the server's own (`usage`). Batch size = concurrency: B workers, each sends
its next request the moment its previous one ends. Output length is asked for with
`max_tokens` = `min_tokens` and `ignore_eos` (vLLM / tokenmill extensions; `--plain-openai`
leaves the last two out) and checked afterwards against `usage.completion_tokens`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from tokenmill.bench.metrics import RequestRecord
from tokenmill.bench.runner import RunOutcome
from tokenmill.bench.workloads import Request
from tokenmill.http_client import TRANSPORT_ERRORS, client_session, describe_error
from tokenmill.openai_compat import api_root

CONNECT_TIMEOUT_S = 10.0


class EndpointTarget:
    kind = "endpoint"

    def __init__(self, url: str, tokenizer: Any, model: str | None = None, api_key: str | None = None,
                 plain_openai: bool = False, timeout_s: float = 600.0) -> None:
        self.base = api_root(url)
        self.tokenizer = tokenizer
        self.api_key = api_key
        self.plain_openai = plain_openai
        # A bound on silence, not on the whole request: a long generation streams for as long as it takes.
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=timeout_s)
        self.model = model or asyncio.run(self._first_model())
        self.label = f"{self.model} @ {self.base}"

    async def _first_model(self) -> str:
        timeout = aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S)
        async with client_session(self.base, timeout, 1, self.api_key) as client, client.get("v1/models") as reply:
            reply.raise_for_status()
            return str((await reply.json(content_type=None))["data"][0]["id"])

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": self.model, "endpoint": self.base,
                "plain_openai": self.plain_openai}

    def prompt_for(self, req: Request) -> str:
        """Text that the tokenizer reads back as exactly `req.input_len` tokens (when it can)."""
        if req.prompt is not None and req.prompt_token_ids is None:
            return req.prompt
        ids = list(req.prompt_token_ids or [])
        for _ in range(4):  # decode -> encode can merge or split tokens at the edges
            text = self.tokenizer.decode(ids)
            again = list(self.tokenizer.encode(text, add_special_tokens=False))
            if len(again) == req.input_len:
                return text
            ids = (again + ids)[: req.input_len]
        return self.tokenizer.decode(ids)

    def run(self, requests: list[Request], batch_size: int) -> RunOutcome:
        prompts = [self.prompt_for(r) for r in requests]  # tokenised before the clock starts
        return asyncio.run(self._run(requests, prompts, batch_size))

    async def _run(self, requests: list[Request], prompts: list[str], concurrency: int) -> RunOutcome:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(requests)):
            queue.put_nowait(i)
        records: list[RequestRecord | None] = [None] * len(requests)
        async with client_session(self.base, self.timeout, concurrency, self.api_key) as client:
            t0 = time.monotonic()

            async def worker() -> None:
                while not queue.empty():
                    i = queue.get_nowait()
                    records[i] = await self._one(client, i, requests[i], prompts[i], t0)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            wall = time.monotonic() - t0
        return RunOutcome([r for r in records if r is not None], wall)

    def _body(self, req: Request, prompt: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": req.output_len,
                                "temperature": 0.0, "stream": True,
                                "stream_options": {"include_usage": True}}
        if not self.plain_openai:
            body |= {"min_tokens": req.output_len, "ignore_eos": True}
        return body

    async def _one(self, client: aiohttp.ClientSession, i: int, req: Request, prompt: str,
                   t0: float) -> RequestRecord:
        rec = RequestRecord(f"req-{i}", req.input_len, req.output_len, 0, 0, 0,
                            time.monotonic() - t0, None, None)
        usage: dict[str, Any] | None = None
        try:
            async with client.post("v1/completions", json=self._body(req, prompt)) as reply:
                if reply.status != 200:
                    rec.error = f"HTTP {reply.status}: {(await reply.read())[:200]!r}"
                    return rec
                async for line in _lines(reply.content):  # as each arrives: the token times are the chunks'
                    usage = _on_line(line, rec, time.monotonic() - t0) or usage
        except TRANSPORT_ERRORS as exc:
            rec.error = describe_error(exc)
            return rec
        rec.end = time.monotonic() - t0
        _apply_usage(rec, usage)
        return rec


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The body's lines, each as soon as the bytes that end it arrive, however long: aiohttp's own
    line reader refuses one over its read buffer (128 to 512 KiB, by version), and a server that
    ignores `stream` sends its whole answer as one."""
    pending: list[bytes] = []  # the start of a line not ended yet
    async for chunk in content.iter_any():
        *ended, rest = chunk.split(b"\n")
        for line in ended:
            yield b"".join([*pending, line]).decode("utf-8", "replace")
            pending = []
        pending.append(rest)
    if last := b"".join(pending):
        yield last.decode("utf-8", "replace")


def _on_line(line: str, rec: RequestRecord, now: float) -> dict[str, Any] | None:
    """Handle one SSE line; returns the usage object when the line carries one."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    chunk = json.loads(data)
    for choice in chunk.get("choices") or []:
        if choice.get("text"):
            rec.token_times.append(now)
            if rec.first_token is None:
                rec.first_token = now
    return chunk.get("usage")


def _apply_usage(rec: RequestRecord, usage: dict[str, Any] | None) -> None:
    if not usage:
        # No usage: count chunks as tokens and flag it, rather than guess silently.
        rec.output_tokens = len(rec.token_times)
        rec.input_tokens = rec.input_len_requested
        return
    rec.input_tokens = int(usage.get("prompt_tokens") or 0)
    rec.output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    rec.cached_tokens = int(details.get("cached_tokens") or 0)
    if rec.first_token is None and rec.output_tokens:
        rec.first_token = rec.end
