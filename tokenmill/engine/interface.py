"""The interface the job backend, the benchmark and the OpenAI translation drive an in-process engine
by: what `LLM` / `LLMEngine` offer them, written down so that another engine (vLLM's, through
tokenmill/vllm_engine/) can stand in for the embedded one and a type checker holds both to it."""

from __future__ import annotations

from typing import Any, Protocol

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm_engine import Prompt
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.engine.scheduler import SchedulerMetrics, SchedulerStats


class StepEngine(Protocol):
    """Requests in, one step at a time, outputs out."""

    config: EngineConfig
    max_model_len: int

    @property
    def num_kv_blocks(self) -> int: ...

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def abort_request(self, request_id: str) -> RequestOutput | None: ...

    def has_started(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> SchedulerStats: ...

    def metrics(self) -> SchedulerMetrics: ...

    def set_max_num_seqs(self, max_num_seqs: int) -> None: ...

    def check_prompt_chars(self, num_chars: int) -> None: ...

    def check_structured_outputs(self, structured_outputs: StructuredOutputsParams) -> None: ...


class InProcessModel(Protocol):
    """A loaded model: its engine, its tokenizer, conversations through its chat template."""

    @property
    def engine(self) -> StepEngine: ...

    @property
    def tokenizer(self) -> Any: ...

    def chat_token_ids(self, messages: list[dict[str, str]],
                       template_kwargs: dict[str, Any] | None = None) -> list[int]: ...
