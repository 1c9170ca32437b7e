"""What serves a job's requests: the embedded engine, OpenAI-compatible endpoints, a provider's
Batch API, and Ray replicas of any of them, behind one contract (base.py).

What other packages use of it is exported here; the modules behind it are the backends' own.
"""

from tokenmill.jobs.backends.base import Backend, BackendStats, ResultSink, StopFlag
from tokenmill.jobs.backends.batch_api import BatchApiSpec
from tokenmill.jobs.backends.batch_parts import (
           OPENAI_MAX_BYTES,
           OPENAI_MAX_REQUESTS,
           OpenPart,
           PartSplitter,
           check_limits,
)
from tokenmill.jobs.backends.build import BackendSpec, build_backend, built_backend
from tokenmill.jobs.backends.embedding import EmbeddingBackend
from tokenmill.jobs.backends.endpoint import EndpointBackend, EndpointSpec
from tokenmill.jobs.backends.http import RetryPolicy
from tokenmill.jobs.backends.rate_limit import RateLimit
from tokenmill.jobs.backends.ray import RayOptions, RaySpec

__all__ = ["OPENAI_MAX_BYTES", "OPENAI_MAX_REQUESTS", "Backend", "BackendSpec", "BackendStats", "BatchApiSpec",
           "EmbeddingBackend", "EndpointBackend", "EndpointSpec", "OpenPart", "PartSplitter", "RateLimit",
           "RayOptions", "RaySpec", "ResultSink", "RetryPolicy", "StopFlag", "build_backend", "built_backend",
           "check_limits"]
