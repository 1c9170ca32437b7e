"""What the server's routes share: the model, its engine loop, the backend that turns OpenAI
bodies into engine requests, the Batch API's files and batches, and the metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.engine import InProcessModel
from tokenmill.jobs.journal import OutputLock
from tokenmill.serve.backend import ServingBackend
from tokenmill.serve.batches import BatchManager, FileStore
from tokenmill.serve.engine_loop import EngineLoop
from tokenmill.serve.errors import APIError
from tokenmill.serve.limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_UPLOAD_BYTES
from tokenmill.serve.metrics import ServeMetrics

LOCK_NAME = "serve.lock"  # in the state dir, held by the server that owns it


def hold_state_dir(state_dir: Path) -> OutputLock:
    """One server per state dir, held from before the model loads until it stops: two would each
    run the other's batches and rewrite each other's records."""
    return OutputLock(state_dir / LOCK_NAME, state_dir, advice="choose another --state-dir")


@dataclass
class ServeState:
    llm: InProcessModel  # the embedded engine or vLLM's
    model_name: str
    state_dir: Path
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a JSON body (413 over it)
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES  # a `POST /v1/files` file (413 over it)
    docs: bool = True  # serve /docs, /redoc and /openapi.json
    max_tokens_limit: int | None = None  # the most tokens a request may ask for (400 over it); None: the context
    # The Batch API's clock (Unix seconds): batch deadlines, output file expiry. Tests move it on
    # to let a batch's 24 h go by in an instant.
    clock: Callable[[], float] = time.time
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.metrics = ServeMetrics(lambda: self.loop.snapshot, self.model_name)
        self.loop = EngineLoop(self.llm.engine, self.metrics)
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"--max-tokens-limit must be at least 1, got {self.max_tokens_limit}")
        self.backend = ServingBackend(self.llm, self.loop, self.model_name, max_tokens_limit=self.max_tokens_limit)
        self.files = FileStore(self.state_dir, self.clock)
        self.batches = BatchManager(self.state_dir, self.files, self._batch_backend, self.model_name, self.clock)

    def _batch_backend(self, batch_id: str, endpoint: str) -> ServingBackend:
        return ServingBackend(self.llm, self.loop, self.model_name, batch_id=batch_id, endpoint=endpoint,
                              max_tokens_limit=self.max_tokens_limit)

    def start(self) -> None:
        self.loop.start()
        self.batches.start()

    def close(self) -> None:
        self.batches.close()  # first: its in-flight requests are aborted through the loop
        self.loop.stop()
        self.backend.close()

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist (this server serves `{self.model_name}`)",
                           param="model", code="model_not_found")

    def model_object(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "tokenmill",
                "max_model_len": self.llm.engine.max_model_len}
