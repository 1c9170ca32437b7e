"""What runs a job's requests, as a typed spec, and the one place a spec becomes a `Backend`.

`tokenmill run`'s flags (flags.py), each `tokenmill choose` candidate and a Python caller build one
of these, each beside the backend it describes:
- `EngineConfig` / `VllmConfig` (engine/, vllm_engine/): an engine in this process (embedded.py);
- `EmbeddingConfig` / `VllmEmbeddingConfig` (embed/, vllm_engine/): an embedding model in this process
  (embedding.py);
- `EndpointSpec` (endpoint.py): an OpenAI-compatible server, or a tuple of them that share the rows;
- `BatchApiSpec` (batch_api.py): an OpenAI-compatible server's Batch API (half price on OpenAI);
- `RaySpec` (ray_runner.py): Ray replicas, each running one of those.
Each validates itself when built (ValueError naming the flag), so a spec that exists can run;
`build_backend` turns it into the backend, loading nothing (a model loads in `Backend.start`);
`built_backend` does too, and closes what the backend loaded when the caller's jobs are done.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from tokenmill.embed.config import EmbeddingConfig
from tokenmill.engine import EngineConfig
from tokenmill.jobs.backends.base import Backend, HoldsModel
from tokenmill.jobs.backends.batch_api import BatchApiSpec
from tokenmill.jobs.backends.endpoint import EndpointSpec
from tokenmill.jobs.backends.ray import RaySpec
from tokenmill.vllm_engine.config import VllmConfig, VllmEmbeddingConfig

BackendSpec = (EngineConfig | VllmConfig | EmbeddingConfig | VllmEmbeddingConfig | EndpointSpec
               | tuple[EndpointSpec, ...] | BatchApiSpec | RaySpec)


def build_backend(spec: BackendSpec) -> Backend:
    """The backend for `spec`. Imports only what it needs: an endpoint job loads no torch."""
    if isinstance(spec, RaySpec):
        from tokenmill.jobs.backends.ray import RayBackend

        return RayBackend(_replica_backends(spec), spec.resolved_options())
    if isinstance(spec, BatchApiSpec):
        from tokenmill.jobs.backends.batch_api import BatchApiBackend

        return BatchApiBackend(spec)
    if isinstance(spec, EndpointSpec | tuple):
        from tokenmill.jobs.backends.endpoint import EndpointBackend

        return EndpointBackend(spec)
    if isinstance(spec, EmbeddingConfig | VllmEmbeddingConfig):
        from tokenmill.jobs.backends.embedding import EmbeddingBackend

        return EmbeddingBackend(spec)
    from tokenmill.jobs.backends.embedded import EmbeddedBackend

    return EmbeddedBackend(spec)


@contextmanager
def built_backend(spec: BackendSpec) -> Iterator[Backend]:
    """The backend for `spec`, closed (its model let go) when the block ends, however it ends."""
    backend = build_backend(spec)
    try:
        yield backend
    finally:
        if isinstance(backend, HoldsModel):
            backend.close()


def _replica_backends(spec: RaySpec) -> list[Backend]:
    """What each Ray actor gets a copy of (not started: each actor loads its own)."""
    if isinstance(spec.replica, tuple):
        # Each replica's share of the job's concurrency and of each endpoint's rate limits.
        share = spec.options.replicas
        return [build_backend(replace(endpoint, concurrency=spec.endpoint_share,
                                      rate_limit=endpoint.rate_limit.share(share)))
                for endpoint in spec.replica]
    engine = spec.replica
    if isinstance(engine, EngineConfig) and engine.num_threads is None:
        # A replica's torch threads = its CPUs, so replicas on one machine do not fight for cores.
        engine = replace(engine, num_threads=max(1, int(spec.options.cpus_per_replica)))
    return [build_backend(engine)]
