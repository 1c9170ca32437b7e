"""The HTTP backend: any OpenAI-compatible server (vLLM, SGLang, a hosted API, tokenmill serve).

`concurrency` workers each take the next request and POST its body. 429, 5xx, timeouts and
dropped connections are retried with exponential backoff and jitter (Retry-After honoured); any
other 4xx is the request's own fault and is recorded as its final error.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from tokenmill.jobs.backend import BackendStats, ResultSink, StopFlag
from tokenmill.jobs.spec import BatchRequest
from tokenmill.openai_compat import new_id


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 6
    base_delay: float = 0.5  # seconds before the 2nd attempt (then doubled each time)
    max_delay: float = 30.0  # cap on one backoff
    max_total_backoff: float = 120.0  # give up on a request once its waits would pass this
    max_retry_after: float = 300.0  # cap on what a server may ask us to wait

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"--max-attempts must be >= 1, got {self.max_attempts}")

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """Equal jitter: half the exponential delay for sure, the other half at random, so
        workers that failed together do not come back together."""
        delay = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
        return delay / 2 + rng.uniform(0, delay / 2)


@dataclass
class Attempt:
    """One HTTP try: a body on success, else a code and message, and whether to try again."""

    body: dict[str, Any] | None = None
    request_id: str | None = None
    code: str = ""
    message: str = ""
    retry: bool = False
    retry_after: float | None = None
    response: dict[str, Any] | None = None  # status_code, request_id, body of an HTTP error


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Retry-After as seconds (`120`) or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class EndpointBackend:
    kind = "endpoint"

    def __init__(
        self, url: str, *, api_key: str | None = None, concurrency: int = 8, timeout: float = 600.0,
        retry: RetryPolicy | None = None, model: str | None = None, seed: int | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--endpoint must be an http:// or https:// URL, got {url!r}")
        if concurrency <= 0:
            raise ValueError(f"--concurrency must be positive, got {concurrency}")
        base = url.rstrip("/")
        self.base_url = base[: -len("/v1")] if base.endswith("/v1") else base  # request urls start with /v1
        self.api_key, self.concurrency, self.timeout = api_key, concurrency, timeout
        self.retry = retry or RetryPolicy()
        self.model = model or "as in each request"
        self._rng = random.Random(seed)
        self._retries = 0

    def check(self, request: BatchRequest) -> None:
        """The server has the last word on what it supports."""

    def start(self) -> None:
        """Connections are opened per run."""

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        self._retries = 0
        asyncio.run(self._run(requests, sink, stop))
        return BackendStats(retries=self._retries)

    async def _run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        stopping = asyncio.Event()  # wakes workers sleeping in a backoff
        async with httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=httpx.Timeout(self.timeout), limits=limits
        ) as client:
            workers = [asyncio.create_task(self._worker(client, requests, sink, stop, stopping))
                       for _ in range(self.concurrency)]
            watcher = asyncio.create_task(_watch(stop, stopping, workers))
            await asyncio.wait(workers)
            watcher.cancel()
        for task in workers:  # a bug in a worker must not pass silently
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    async def _worker(
        self, client: httpx.AsyncClient, requests: Iterator[BatchRequest], sink: ResultSink,
        stop: StopFlag, stopping: asyncio.Event,
    ) -> None:
        while not stop.requested:
            request = next(requests, None)  # one thread: workers take turns without a lock
            if request is None:
                return
            await self._serve(client, request, sink, stopping)

    async def _serve(
        self, client: httpx.AsyncClient, request: BatchRequest, sink: ResultSink, stopping: asyncio.Event
    ) -> None:
        waited = 0.0
        for attempt in range(1, self.retry.max_attempts + 1):
            result = await self._attempt(client, request)
            if result.body is not None:
                sink.result(request, result.body, result.request_id)
                return
            if not result.retry:
                sink.error(request, result.code, result.message, result.response)
                return
            if attempt == self.retry.max_attempts:
                break
            delay = result.retry_after
            delay = self.retry.backoff(attempt, self._rng) if delay is None else min(delay, self.retry.max_retry_after)
            if waited + delay > self.retry.max_total_backoff:
                break
            if await _sleep_unless(stopping, delay):
                return  # stopping: left not done, so a re-run does it
            waited += delay
            self._retries += 1
        message = f"{result.message} (gave up after {attempt} attempt(s), {waited:.1f} s of backoff)"
        sink.error(request, result.code, message, result.response)

    async def _attempt(self, client: httpx.AsyncClient, request: BatchRequest) -> Attempt:
        try:
            reply = await client.post(request.url, json=request.body)
        except httpx.TimeoutException as exc:
            return Attempt(code="timeout", message=f"no reply within {self.timeout:g} s ({type(exc).__name__})",
                           retry=True)
        except httpx.TransportError as exc:  # refused, reset, dropped mid-reply
            return Attempt(code="connection_error", message=f"{type(exc).__name__}: {exc}", retry=True)
        request_id = reply.headers.get("x-request-id") or new_id("req_")
        body = _json_or_none(reply)
        if 200 <= reply.status_code < 300:
            if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
                return Attempt(code="bad_response", message=f"HTTP {reply.status_code} without a completion body",
                               retry=True)
            return Attempt(body=body, request_id=request_id)
        response = {"status_code": reply.status_code, "request_id": request_id,
                    "body": body if body is not None else reply.text[:2000]}
        message = f"HTTP {reply.status_code}: {_error_message(body, reply.text)}"
        retry_after = parse_retry_after(reply.headers.get("retry-after"))
        if reply.status_code == 429:
            return Attempt(code="rate_limited", message=message, retry=True, retry_after=retry_after, response=response)
        if reply.status_code >= 500:
            return Attempt(code="server_error", message=message, retry=True, retry_after=retry_after, response=response)
        return Attempt(code=f"http_{reply.status_code}", message=message, response=response)


async def _watch(stop: StopFlag, stopping: asyncio.Event, workers: list[asyncio.Task[None]]) -> None:
    """Turn the signal flags into asyncio: wake sleepers on the first, cancel in-flight on the second."""
    while True:
        if stop.requested:
            stopping.set()
        if stop.forced:
            for task in workers:
                task.cancel()
            return
        await asyncio.sleep(0.05)


async def _sleep_unless(event: asyncio.Event, seconds: float) -> bool:
    """Sleep; True if `event` was set first."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        return False
    return True


def _json_or_none(reply: httpx.Response) -> Any:
    try:
        return reply.json()
    except ValueError:
        return None


def _error_message(body: Any, text: str) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if body.get("message"):
            return str(body["message"])
    return text.strip()[:300] or "(empty body)"
