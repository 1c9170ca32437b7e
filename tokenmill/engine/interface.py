"""The contract between an in-process engine and the code that drives it (jobs, the benchmark, the
server, the OpenAI translation), written down so that vLLM's engine (tokenmill/vllm_engine/) stands
in for the embedded one and a type checker holds both to it.

- `EngineSpec`: what to load (`EngineConfig`, `VllmConfig`); tokenmill/engines.py loads it into
  an `InProcessModel`.
- `InProcessModel`: a loaded model: its `StepEngine`, its tokenizer, its chat template.
- `StepEngine`: requests in, one step at a time, outputs out. Both engines implement all of it,
  and both process a request with the one `InputProcessor` (engine/processor.py).
- What goes in and out: `EngineRequest` (processed, waiting to be added), `RequestOutput` with its
  `FinishReason`, `RequestTimings` and `TokenLogprob`s, and the counters (`SchedulerStats`,
  `SchedulerMetrics`).
- `EngineCapabilities`: what one engine does that the other does not, declared by the engine for
  callers to read.

Nothing here imports torch, nor a module that does: a command that never loads a model never pays
for it, and the engine's own modules build on these types (so this module imports none of them but
the prompt forms and the sampling settings).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from tokenmill.engine.prompt import Prompt
    from tokenmill.engine.sampling_params import SamplingParams, StructuredOutputsParams


class FinishReason(StrEnum):
    """Why a request ended; the value is what an OpenAI body's `finish_reason` says (and vLLM's)."""

    STOP = "stop"  # an end-of-sequence token, a stop token or string, or a completed structured output
    LENGTH = "length"  # max_tokens generated, or the context is full
    ABORT = "abort"  # dropped by the caller (`abort_request`)
    ERROR = "error"  # refused or failed inside the engine: the output's `error` says why


@dataclass(frozen=True)
class EngineRequest:
    """A request tokenized and checked by `StepEngine.process_request` (on any thread), waiting to be
    added with `add_processed` on the thread that steps the engine. What only one engine needs (the
    embedded engine's grammar matcher, its seed for an unseeded request) it derives when it adds it."""

    request_id: str
    prompt: str | None  # the prompt as text, where it came as text
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: float  # time.monotonic() when processed: a wait before `add_processed` counts


@dataclass
class RequestTimings:
    """Monotonic-clock timestamps (time.monotonic seconds) of one request's life."""

    arrival: float
    scheduled: float | None = None  # first time any of its tokens were scheduled
    first_token: float | None = None
    finished: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability (natural log) and its `top` most likely alternatives,
    as (token id, logprob) pairs, most likely first; the token itself may be among them. The
    embedded engine's are before temperature, top-k and top-p, over the tokens a grammar allows
    (see `Sampler`); vLLM's are from its raw logits."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What an engine hands back for a request: where it stands after a step, or how it ended."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None  # None while unfinished
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int | None  # None: the engine counts them only in all (vLLM: `stats()`)
    timings: RequestTimings
    finished: bool
    error: str | None = None  # why the request was refused (FinishReason.ERROR)
    # One per token of token_ids where SamplingParams.logprobs asked for them; None otherwise. A
    # stop string cuts `text` but not `token_ids`, so these stay one per token, as in vLLM.
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def refused(cls, request_id: str, reason: str) -> RequestOutput:
        """The output of a request the engine would not take (too long, a bad value): no tokens."""
        return cls(request_id, None, [], "", [], FinishReason.ERROR, None, 0, 0, 0,
                   RequestTimings(time.monotonic()), True, error=reason)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerStats:
    """Cumulative counters (tokens, not requests, for the prefix cache)."""

    prefix_cache_queries: int = 0  # prompt tokens looked up at first admission
    prefix_cache_hits: int = 0  # of which served from the cache
    num_preemptions: int = 0
    num_steps: int = 0
    prefill_tokens: int = 0  # tokens computed that were already known (prompt or recompute)
    decode_tokens: int = 0  # tokens computed that came from the previous sample (and accepted drafts)
    # Speculative decoding (vLLM's counters): sequences that carried drafts in a step, their draft
    # tokens, and how many of those the target accepted.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def draft_acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a step with drafts produced per sequence: vLLM's 1 + accepted / drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass
class SchedulerMetrics:
    """A point-in-time view for progress bars, metrics endpoints and benchmarks."""

    num_running: int
    num_waiting: int
    kv_usage: float
    stats: SchedulerStats


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine does beyond the contract both keep, declared by the engine so that callers
    read it instead of probing the engine's type."""

    # Compiles a structured output for this model before any request carries it: ValueError
    # ("structured_outputs.<kind>: why") where it does not compile, so a job or the server refuses
    # it up front naming the body field. None where the engine compiles it only when the request is
    # submitted (vLLM), and one that does not compile comes back as that request's output with
    # FinishReason.ERROR.
    check_structured_outputs: Callable[[StructuredOutputsParams], None] | None = None


class StepEngine(Protocol):
    name: str  # "embedded" | "vllm": in messages and reports
    model: str | None  # the model it was asked to load (None: the embedded default)
    max_model_len: int  # as resolved from the model and the settings
    max_num_seqs: int  # the largest running batch it was built for
    capabilities: EngineCapabilities

    def check_prompt_chars(self, num_chars: int) -> None:
        """ValueError for a text prompt of this many characters that cannot fit the context, said
        without tokenizing it (see `InputProcessor.max_prompt_chars`)."""

    def process_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                        priority: int = 0) -> EngineRequest:
        """Validate and tokenize, on any thread; ValueError for a request the engine refuses
        (empty, longer than the context). Touches no engine state."""

    def add_processed(self, request: EngineRequest) -> str:
        """Queue a request from `process_request`, on the thread that steps the engine."""

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0) -> str:
        """`process_request` then `add_processed`."""

    def step(self) -> list[RequestOutput]:
        """One step: the outputs of every request that advanced (or was refused) in it."""

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a request; its last output with FinishReason.ABORT (None: not known here)."""

    def has_started(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> SchedulerStats:
        """A copy of the cumulative counters: tokens prefilled and decoded, preemptions."""

    def metrics(self) -> SchedulerMetrics:
        """Running and waiting counts, KV-cache usage and the counters, safe to read on another thread."""

    def set_max_num_seqs(self, max_num_seqs: int) -> None:
        """Cap the running batch at or below `max_num_seqs` (bench measures one engine at several sizes)."""

    def describe(self) -> dict[str, Any]:
        """The settings it runs with, resolved (for reports: bench JSON, `tokenmill serve`)."""

    def close(self) -> None:
        """Free what it holds now (vLLM's engine process) rather than at garbage collection."""


class InProcessModel(Protocol):
    """A loaded model: its engine, its tokenizer, conversations through its chat template."""

    @property
    def engine(self) -> StepEngine: ...

    @property
    def tokenizer(self) -> Any: ...

    def chat_token_ids(self, messages: list[dict[str, str]],
                       template_kwargs: dict[str, Any] | None = None) -> list[int]: ...


class EngineSpec(Protocol):
    """What to load and how: `EngineConfig` (the embedded engine) or `VllmConfig` (vLLM's)."""

    engine: ClassVar[str]  # "embedded" | "vllm"
    model: str | None  # None: the embedded default model

    @property
    def max_num_seqs(self) -> int | None: ...

    def for_share_of_machine(self, share: float) -> EngineSpec:
        """A copy for an engine that gets `share` (0–1] of this machine beside others (Ray replicas)."""
