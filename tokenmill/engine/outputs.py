"""What the engine hands back for each request."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenmill.engine.sequence import RequestTimings, TokenLogprob


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"; None while unfinished
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int | None  # None: the engine counts them only in all (vLLM: `stats()`)
    timings: RequestTimings
    finished: bool
    error: str | None = None  # why the request was refused (finish_reason "error")
    # One per token of token_ids where SamplingParams.logprobs asked for them; None otherwise. A
    # stop string cuts `text` but not `token_ids`, so these stay one per token, as in vLLM.
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def refused(cls, request_id: str, reason: str) -> RequestOutput:
        """The output of a request the engine would not take (too long, a bad value): no tokens."""
        return cls(request_id, None, [], "", [], "error", None, 0, 0, 0, RequestTimings(time.monotonic()),
                   True, error=reason)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
