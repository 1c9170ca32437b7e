"""A request inside the engine: the tokens it knows and how many of them have been computed.

The scheduler's whole job is closing the gap `num_tokens - num_computed_tokens` under a token
budget; prefill, chunked prefill, prefix-cache hits and recompute after preemption are all
just different starting points of that gap, and draft tokens (speculative decoding) widen it by
tokens known only tentatively.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.interface import FinishReason, RequestTimings, TokenLogprob
from tokenmill.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    priority: int = 0
    arrival_order: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    num_registered_blocks: int = 0  # leading blocks already entered into the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    output_text: str = ""
    num_preemptions: int = 0
    seed: int = 0  # a sampled token's noise is drawn from (seed, its position): see sampler.py
    matcher: Any = None  # llguidance.LLMatcher of a structured-output request: the tokens it allows next
    # Tokens proposed after the known ones, for this step to verify (engine/speculative/), and the
    # proposer's own state of this request.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_state: Any = None
    error: str | None = None  # why it finished with FinishReason.ERROR
    # One entry per output token, where params.logprobs asks for them (None otherwise). Kept across
    # preemption like the tokens themselves: a recompute samples only tokens not yet generated.
    logprobs: list[TokenLogprob] | None = None
    timings: RequestTimings = field(default_factory=lambda: RequestTimings(time.monotonic()))

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.logprobs is None and self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True while known tokens other than the newest sampled one are still uncomputed."""
        return self.num_tokens - self.num_computed_tokens > 1 or self.num_output_tokens == 0
