"""tokenmill: throughput-first batch LLM inference.

The Python API, for notebooks and pipelines (README, "Python API"): the offline engine (`LLM`,
`SamplingParams`), the embedding engine (`Embedder`, `EmbeddingConfig`), and batch jobs as the
command line runs them — a `JobConfig`, a backend spec
(`EngineConfig`, `VllmConfig`, `EndpointSpec`, `BatchApiSpec`, `RaySpec`), `build_backend`,
`run_job`, and the `JobOutcome` it returns.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.embed.config import EmbeddingConfig
    from tokenmill.embed.embedder import Embedder
    from tokenmill.engine import LLM, EngineConfig, LLMEngine, RequestOutput, SamplingParams, StructuredOutputsParams
    from tokenmill.jobs.backends.batch_api import BatchApiSpec
    from tokenmill.jobs.backends.build import build_backend
    from tokenmill.jobs.backends.endpoint import EndpointSpec
    from tokenmill.jobs.backends.http import RetryPolicy
    from tokenmill.jobs.backends.rate_limit import RateLimit
    from tokenmill.jobs.backends.ray import RayOptions, RaySpec
    from tokenmill.jobs.config import JobConfig
    from tokenmill.jobs.input.request import DocumentOptions
    from tokenmill.jobs.runner import run_job
    from tokenmill.jobs.summary import JobOutcome
    from tokenmill.vllm_engine.config import VllmConfig

# name -> the module that owns it. Loaded on first use, so `import tokenmill.cli` (every command)
# imports no torch.
_EXPORTS = {
    **dict.fromkeys(["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams",
                     "StructuredOutputsParams"], "tokenmill.engine"),
    "VllmConfig": "tokenmill.vllm_engine.config",
    "Embedder": "tokenmill.embed.embedder",
    "EmbeddingConfig": "tokenmill.embed.config",
    "EndpointSpec": "tokenmill.jobs.backends.endpoint",
    "BatchApiSpec": "tokenmill.jobs.backends.batch_api",
    "RaySpec": "tokenmill.jobs.backends.ray",
    "build_backend": "tokenmill.jobs.backends.build",
    "RetryPolicy": "tokenmill.jobs.backends.http",
    "RateLimit": "tokenmill.jobs.backends.rate_limit",
    "RayOptions": "tokenmill.jobs.backends.ray",
    "JobConfig": "tokenmill.jobs.config",
    "DocumentOptions": "tokenmill.jobs.input.request",
    "run_job": "tokenmill.jobs.runner",
    "JobOutcome": "tokenmill.jobs.summary",
}
__all__ = [
    "LLM",
    "BatchApiSpec",
    "DocumentOptions",
    "Embedder",
    "EmbeddingConfig",
    "EndpointSpec",
    "EngineConfig",
    "JobConfig",
    "JobOutcome",
    "LLMEngine",
    "RateLimit",
    "RayOptions",
    "RaySpec",
    "RequestOutput",
    "RetryPolicy",
    "SamplingParams",
    "StructuredOutputsParams",
    "VllmConfig",
    "build_backend",
    "run_job",
]
__version__ = "0.1.0"
assert set(__all__) == set(_EXPORTS)  # one list, written out for readers and linters


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
