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
from typing import Any

import httpx

from tokenmill.bench.metrics import RequestRecord
from tokenmill.bench.runner import RunOutcome
from tokenmill.bench.workloads import Request
from tokenmill.openai_compat import api_root


class EndpointTarget:
    kind = "endpoint"

    def __init__(self, url: str, tokenizer: Any, model: str | None = None, api_key: str | None = None,
                 plain_openai: bool = False, timeout_s: float = 600.0) -> None:
        self.base = api_root(url)
        self.tokenizer = tokenizer
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.plain_openai = plain_openai
        self.timeout = httpx.Timeout(timeout_s, connect=10.0)
        self.model = model or self._first_model()
        self.label = f"{self.model} @ {self.base}"

    def _first_model(self) -> str:
        reply = httpx.get(f"{self.base}/v1/models", headers=self.headers, timeout=10.0)
        reply.raise_for_status()
        return str(reply.json()["data"][0]["id"])

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
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits, headers=self.headers) as client:
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

    async def _one(self, client: httpx.AsyncClient, i: int, req: Request, prompt: str,
                   t0: float) -> RequestRecord:
        rec = RequestRecord(f"req-{i}", req.input_len, req.output_len, 0, 0, 0,
                            time.monotonic() - t0, None, None)
        usage: dict[str, Any] | None = None
        try:
            async with client.stream("POST", f"{self.base}/v1/completions",
                                     json=self._body(req, prompt)) as reply:
                if reply.status_code != 200:
                    rec.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
                    return rec
                async for line in reply.aiter_lines():
                    usage = _on_line(line, rec, time.monotonic() - t0) or usage
        except httpx.HTTPError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            return rec
        rec.end = time.monotonic() - t0
        _apply_usage(rec, usage)
        return rec


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
