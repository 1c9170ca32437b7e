"""The embedded inference engine: scheduler, paged KV cache, model runner."""

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm import LLM
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
