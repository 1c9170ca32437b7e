"""The embedded inference engine: scheduler, paged KV cache, model runner.

Code outside this package uses what is exported here (and `tokenmill.engine.args` for the
command-line flags); the scheduler, block manager and runner stay inside.
"""

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.interface import InProcessModel, StepEngine
from tokenmill.engine.llm import DEFAULT_CHAT_TEMPLATE_KWARGS, LLM, chat_prompt_ids
from tokenmill.engine.llm_engine import EngineRequest, LLMEngine, Prompt
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.perplexity import Perplexity, perplexity
from tokenmill.engine.sampling_params import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    SamplingParams,
    StructuredOutputsParams,
)
from tokenmill.engine.scheduler import SchedulerMetrics, SchedulerStats
from tokenmill.engine.sequence import RequestTimings

__all__ = [
    "DEFAULT_CHAT_TEMPLATE_KWARGS",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_TEMPERATURE",
    "LLM",
    "EngineConfig",
    "EngineRequest",
    "InProcessModel",
    "LLMEngine",
    "Perplexity",
    "Prompt",
    "RequestOutput",
    "RequestTimings",
    "SamplingParams",
    "SchedulerMetrics",
    "SchedulerStats",
    "StepEngine",
    "StructuredOutputsParams",
    "chat_prompt_ids",
    "perplexity",
]
