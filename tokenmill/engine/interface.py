"""The interface jobs, the benchmark, the server and the OpenAI translation drive an in-process
engine by, written down so that vLLM's engine (tokenmill/vllm_engine/) stands in for the embedded
one and a type checker holds both to it.

- `EngineSpec`: what to load (`EngineConfig`, `VllmConfig`); tokenmill/engines.py loads it into
  an `InProcessModel`.
- `InProcessModel`: a loaded model: its `StepEngine`, its tokenizer, its chat template.
- `StepEngine`: requests in, one step at a time, outputs out. Both engines implement all of it.
- `ChecksBeforeTokenizing`: what only the embedded engine can do before a request is tokenized
  (refuse a text prompt by its length, compile a structured output); vLLM does both when the
  request is added, so callers ask `isinstance(engine, ChecksBeforeTokenizing)`.

Only names are imported here (no torch): a command that never loads a model never pays for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tokenmill.engine.llm_engine import EngineRequest
    from tokenmill.engine.outputs import RequestOutput
    from tokenmill.engine.prompt import Prompt
    from tokenmill.engine.sampling_params import SamplingParams, StructuredOutputsParams
    from tokenmill.engine.scheduler import SchedulerMetrics, SchedulerStats


class StepEngine(Protocol):
    name: str  # "embedded" | "vllm": in messages and reports
    model: str | None  # the model it was asked to load (None: the embedded default)
    max_model_len: int  # as resolved from the model and the settings
    max_num_seqs: int  # the largest running batch it was built for

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
        """Drop a request; its last output with finish_reason "abort" (None: not known here)."""

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


@runtime_checkable
class ChecksBeforeTokenizing(Protocol):
    def check_prompt_chars(self, num_chars: int) -> None:
        """ValueError for a text prompt of this many characters that cannot fit the context."""

    def check_structured_outputs(self, structured_outputs: StructuredOutputsParams) -> None:
        """ValueError naming the setting when it does not compile for this model."""


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
