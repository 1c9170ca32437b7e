"""The embedded inference engine: scheduler, paged KV cache, model runner.

Code outside this package uses what is exported here (and `tokenmill.engine.args` for the
command-line flags); the scheduler, block manager and runner stay inside.

The exports load on first use (PEP 562): `from tokenmill.engine import EngineConfig` or
`DEFAULT_MAX_TOKENS` imports neither torch nor the model code, so commands that only parse flags
or call an endpoint start in a fraction of a second.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, for readers and type checkers
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.hidden_states import DecoderEmbeddingModel
    from tokenmill.engine.interface import (
        EngineCapabilities,
        EngineRequest,
        EngineSpec,
        FinishReason,
        InProcessModel,
        RequestOutput,
        RequestTimings,
        SchedulerMetrics,
        SchedulerStats,
        StepEngine,
        TokenLogprob,
    )
    from tokenmill.engine.llm import DEFAULT_CHAT_TEMPLATE_KWARGS, LLM, chat_prompt_ids
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.perplexity import Perplexity, perplexity
    from tokenmill.engine.processor import InputProcessor
    from tokenmill.engine.prompt import Prompt, read_prompt
    from tokenmill.engine.sampling_params import (
        DEFAULT_MAX_TOKENS,
        DEFAULT_TEMPERATURE,
        MAX_LOGPROBS,
        SamplingParams,
        StructuredOutputsParams,
    )
    from tokenmill.engine.speculative.config import DEFAULT_DRAFT_TOKENS, SpeculativeMethod, speculative_config

# export -> the module of this package that defines it
_EXPORTS = {
    "DEFAULT_CHAT_TEMPLATE_KWARGS": "llm",
    "DEFAULT_DRAFT_TOKENS": "speculative.config",
    "DEFAULT_MAX_TOKENS": "sampling_params",
    "DEFAULT_TEMPERATURE": "sampling_params",
    "DecoderEmbeddingModel": "hidden_states",
    "MAX_LOGPROBS": "sampling_params",
    "LLM": "llm",
    "EngineCapabilities": "interface",
    "EngineConfig": "config",
    "EngineSpec": "interface",
    "EngineRequest": "interface",
    "FinishReason": "interface",
    "InProcessModel": "interface",
    "InputProcessor": "processor",
    "LLMEngine": "llm_engine",
    "Perplexity": "perplexity",
    "Prompt": "prompt",
    "read_prompt": "prompt",
    "RequestOutput": "interface",
    "RequestTimings": "interface",
    "SamplingParams": "sampling_params",
    "SchedulerMetrics": "interface",
    "SchedulerStats": "interface",
    "SpeculativeMethod": "speculative.config",
    "StepEngine": "interface",
    "StructuredOutputsParams": "sampling_params",
    "TokenLogprob": "interface",
    "chat_prompt_ids": "llm",
    "perplexity": "perplexity",
    "speculative_config": "speculative.config",
}
__all__ = [
    "DEFAULT_CHAT_TEMPLATE_KWARGS",
    "DEFAULT_DRAFT_TOKENS",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_TEMPERATURE",
    "LLM",
    "MAX_LOGPROBS",
    "DecoderEmbeddingModel",
    "EngineCapabilities",
    "EngineConfig",
    "EngineRequest",
    "EngineSpec",
    "FinishReason",
    "InProcessModel",
    "InputProcessor",
    "LLMEngine",
    "Perplexity",
    "Prompt",
    "RequestOutput",
    "RequestTimings",
    "SamplingParams",
    "SchedulerMetrics",
    "SchedulerStats",
    "SpeculativeMethod",
    "StepEngine",
    "StructuredOutputsParams",
    "TokenLogprob",
    "chat_prompt_ids",
    "perplexity",
    "read_prompt",
    "speculative_config",
]

assert set(__all__) == set(_EXPORTS)  # one list, written out for readers and linters


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # once loaded, a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        # Importing a submodule binds it on this package; where an export has the module's own name
        # (`perplexity`, the function), the export keeps the name, as the eager imports had it.
        if isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}" and name in _EXPORTS:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
