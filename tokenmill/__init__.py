"""tokenmill: throughput-first batch LLM inference."""

from tokenmill.engine import LLM, EngineConfig, LLMEngine, RequestOutput, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"
