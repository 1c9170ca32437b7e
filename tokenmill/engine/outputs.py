"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.sequence import RequestTimings


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while unfinished
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    timings: RequestTimings
    finished: bool

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
