"""What every backend that speaks HTTP (a live endpoint, a provider's Batch API) shares: the error
code of a reply's status, the message of an error body, and how long and how often to try again.
The client itself (a session, its proxy, what a request that got no reply raises) is
tokenmill/http_client.py, which `tokenmill bench` uses too."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tokenmill.jobs.journal.rows import ErrorCode, http_code
from tokenmill.settings import SettingError, setting

DOWN_STATUSES = frozenset({502, 503, 504})  # a gateway saying the server behind it is not there
TIMEOUT_S = 600.0  # one HTTP attempt's limit, for every backend that speaks HTTP
RETRY_FOR_S = 600.0  # how long failures are retried, likewise


def code_of_status(status: int | None) -> str:
    """A failed reply's error code: 429 and 5xx (or no status at all) are transient, any other
    status is the request's own fault and final."""
    if status == 429:
        return ErrorCode.RATE_LIMITED
    if not isinstance(status, int) or status >= 500:
        return ErrorCode.SERVER_ERROR
    return http_code(status)


def error_message(body: Any, text: str) -> str:
    """What an error reply says: OpenAI's `{"error": {"message"}}`, a bare `error` or `message`, else
    the start of its text."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str) and error:
            return error
        if body.get("message"):
            return str(body["message"])
    return text.strip()[:300] or "(empty body)"


@dataclass(frozen=True)
class RetryPolicy:
    """Every number that decides how long an HTTP backend keeps trying (the Batch API's control calls
    use the backoff and the budget)."""

    retry_for: float = setting(
        RETRY_FOR_S, "keep retrying a request's 429s, 5xx, timeouts and lost connections this many seconds; an "
        "endpoint that stays down this long (no answer to probes) ends the job with exit 3, and a re-run resumes",
        metavar="SECONDS")
    max_attempts: int | None = setting(None, "also cap the tries per request (default: no cap, --retry-for decides)")
    base_delay: float = 0.5  # seconds before the 2nd attempt, and before the first probe (then doubled)
    max_delay: float = 30.0  # cap on one request's backoff
    max_retry_after: float = 300.0  # cap on what a server may ask us to wait
    breaker_after: int = 3  # down signals in a row, across an endpoint's workers, that open its breaker
    max_probe_delay: float = 5.0  # cap on the wait between probes: how late we may notice a return
    probe_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.max_attempts is not None and self.max_attempts < 1:
            raise SettingError("{max_attempts} must be >= 1, got {got}", got=self.max_attempts)
        check_retry_for(self.retry_for)

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """Equal jitter: half the exponential delay for sure, the other half at random, so
        workers that failed together do not come back together."""
        delay = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
        return delay / 2 + rng.uniform(0, delay / 2)

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """The wait after a failed `attempt`: the server's Retry-After (capped), else the backoff."""
        return self.backoff(attempt, rng) if retry_after is None else min(retry_after, self.max_retry_after)

    def exhausted(self, attempts: int, spent_s: float) -> bool:
        """Whether a request that failed `attempts` times, and would have spent `spent_s` of its
        budget by its next try, should stop here."""
        return spent_s > self.retry_for or (self.max_attempts is not None and attempts >= self.max_attempts)

    def probe_delay(self, probes: int) -> float:
        return min(self.max_probe_delay, self.base_delay * 2**probes)


def check_retry_for(seconds: float, name: str = "retry_for") -> None:
    """How long failures are retried (RetryPolicy's, and the Batch API's control calls', whose
    field is `name`)."""
    if seconds < 0:
        raise SettingError(f"{{{name}}} must be >= 0, got {{seconds:g}}", seconds=seconds)
