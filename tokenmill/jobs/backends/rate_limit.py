"""An endpoint's rate limits, as OpenAI states them: requests and tokens per minute.

Each limit is a token bucket refilled at its per-minute rate and holding at most one second's
share (or one request, when that is more), so the rate holds over any window, not only on
average over a minute: a full minute's bucket would let a minute's requests out in a burst.
Tokens are counted as OpenAI's rate limiter counts them, before the request runs: the prompt's
characters ÷ 4, plus max_tokens for each of its `n` choices.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.jobs.input.request import BatchRequest
from tokenmill.settings import SettingError, setting

CHARS_PER_TOKEN = 4  # OpenAI's rule of thumb for English text, and what its limiter assumes
TOKEN_ID_CHARS = CHARS_PER_TOKEN  # a prompt given as token ids: each id is one token


@dataclass(frozen=True)
class RateLimit:
    """Requests and tokens per minute one endpoint may receive (None: no limit)."""

    requests_per_minute: float | None = setting(
        None, "send each endpoint at most N requests a minute (OpenAI's RPM), in bursts of at most one second's "
        "share (default: no limit; with --ray, the replicas share it)", flag="--max-requests-per-minute",
        metavar="N")
    tokens_per_minute: float | None = setting(
        None, "send each endpoint at most N tokens a minute (OpenAI's TPM), counted as OpenAI counts them when "
        "a request is sent: its prompt's characters ÷ 4 + max_tokens (default: no limit)",
        flag="--max-tokens-per-minute", metavar="N")

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise SettingError(f"{{{name}}} must be positive, got {{got:g}}", got=value)

    @property
    def limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    def share(self, parts: int) -> RateLimit:
        """One of `parts` clients' share (Ray replicas), so that together they keep the limit."""
        return RateLimit(*(None if value is None else value / parts
                           for value in (self.requests_per_minute, self.tokens_per_minute)))


def estimated_tokens(request: BatchRequest) -> int:
    """What OpenAI's limiter counts against tokens per minute when a request is sent: the prompt
    at ~4 characters a token, plus max_tokens for each choice (all of it, whatever is generated)."""
    body = request.body
    if isinstance(body.get("messages"), list):
        chars = sum(_text_chars(message.get("content")) for message in body["messages"] if isinstance(message, dict))
    else:
        chars = _text_chars(body.get("prompt"))
    choices = body.get("n") if isinstance(body.get("n"), int) else 1
    return chars // CHARS_PER_TOKEN + request.max_tokens * max(1, choices)


def _text_chars(content: Any) -> int:
    """Characters of text in a message's content or a prompt: a string, text parts, token ids."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, dict):
        return _text_chars(content.get("text"))
    if isinstance(content, list):
        return sum(TOKEN_ID_CHARS if isinstance(part, int) else _text_chars(part) for part in content)
    return 0


class _Bucket:
    """A token bucket: refilled at `per_minute`, holding at most one second's share (at least 1).

    A take bigger than the bucket waits for a full bucket, then goes and leaves it in debt, so
    later takes wait until the debt is repaid and the rate still holds; one take never costs more
    than a minute's worth (a request over the whole per-minute limit goes rather than wait forever).
    """

    def __init__(self, per_minute: float) -> None:
        self.per_minute = per_minute
        self.per_s = per_minute / 60
        self.capacity = max(self.per_s, 1.0)
        self.level = self.capacity
        self.at = time.monotonic()

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` may be taken (0: now)."""
        self.level = min(self.capacity, self.level + (now - self.at) * self.per_s)
        self.at = now
        missing = min(amount, self.capacity) - self.level
        return missing / self.per_s if missing > 0 else 0.0

    def take(self, amount: float) -> None:
        self.level -= min(amount, self.per_minute)


class Limiter:
    """When one endpoint's workers may send: its rate limits, and a pause that a 429 with
    Retry-After asks of the whole endpoint (a 429 is about the endpoint, not one request).

    It lives as long as the backend (a Ray replica runs batch after batch: each must not start
    with a fresh burst). Workers call `turn` only when `needed`, so an endpoint without limits that
    never saw a 429 pays nothing per request.
    """

    def __init__(self, limit: RateLimit) -> None:
        self._requests = None if limit.requests_per_minute is None else _Bucket(limit.requests_per_minute)
        self._tokens = None if limit.tokens_per_minute is None else _Bucket(limit.tokens_per_minute)
        self.needed = limit.limited
        self.paused_until = 0.0  # monotonic time
        self._turns: asyncio.Lock | None = None

    def begin_run(self) -> None:
        """A lock for this run's event loop: one worker waits for the next turn at a time, in
        order, the others queue behind it (instead of all waking at every refill)."""
        self._turns = asyncio.Lock()

    def pause(self, seconds: float) -> None:
        self.paused_until = max(self.paused_until, time.monotonic() + seconds)
        self.needed = True

    async def turn(self, request: BatchRequest, halt: asyncio.Event) -> bool:
        """Wait until `request` may be sent, and count it; False when `halt` is set first."""
        tokens = estimated_tokens(request) if self._tokens is not None else 0
        assert self._turns is not None, "begin_run() first"
        async with self._turns:
            while (wait := self._wait_s(tokens)) > 0:
                if await sleep_unless(halt, wait):
                    return False
            if self._requests is not None:
                self._requests.take(1)
            if self._tokens is not None:
                self._tokens.take(tokens)
        return True

    def _wait_s(self, tokens: int) -> float:
        now = time.monotonic()
        waits = [self.paused_until - now]
        if self._requests is not None:
            waits.append(self._requests.wait_s(1, now))
        if self._tokens is not None:
            waits.append(self._tokens.wait_s(tokens, now))
        return max(waits)


async def sleep_unless(event: asyncio.Event, seconds: float) -> bool:
    """Sleep; True if `event` was set first."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        return False
    return True
