"""What the server's routes share: the model, its engine loop and the backend that turns OpenAI
bodies into engine requests (or, for an embedding model, its embedding service), the Batch API's
files and batches, and the metrics."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.embed.inputs import EmbeddingInputs
from tokenmill.engine import InProcessModel
from tokenmill.jobs.backends import Backend
from tokenmill.jobs.journal import OutputLock
from tokenmill.openai_compat import EMBEDDINGS_URL, GENERATION_URLS
from tokenmill.serve.backend import ServingBackend
from tokenmill.serve.batches import BatchManager, FileStore
from tokenmill.serve.embeddings import EmbeddingService
from tokenmill.serve.engine_loop import EngineLoop
from tokenmill.serve.errors import APIError, bad_request
from tokenmill.serve.limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_UPLOAD_BYTES
from tokenmill.serve.metrics import ServeMetrics

LOCK_NAME = "serve.lock"  # in the state dir, held by the server that owns it


def hold_state_dir(state_dir: Path) -> OutputLock:
    """One server per state dir, held from before the model loads until it stops: two would each
    run the other's batches and rewrite each other's records."""
    return OutputLock(state_dir / LOCK_NAME, state_dir, advice="choose another --state-dir")


@dataclass(frozen=True)
class Task:
    """What the served model is for."""

    name: str  # vLLM's word for it, which /v1/models shows
    urls: tuple[str, ...]  # the endpoints that answer it (live and in a batch); the others are a 400
    model_is: str  # how messages say it


GENERATE = Task("generate", GENERATION_URLS, "a text-generation model")
EMBED = Task("embed", (EMBEDDINGS_URL,), "an embedding model")


@dataclass
class ServeState:
    llm: InProcessModel | EmbeddingInputs  # the embedded engine or vLLM's; or an embedding model
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
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"--max-tokens-limit must be at least 1, got {self.max_tokens_limit}")
        self.metrics = ServeMetrics(lambda: self.loop.snapshot if self.loop else None, self.model_name,
                                    lambda: self.embeddings.embedder.stats if self.embeddings else None)
        # A generation model has the engine loop and its backend, an embedding model its service.
        self.loop: EngineLoop | None = None
        self.backend: ServingBackend | None = None
        self.embeddings: EmbeddingService | None = None
        if isinstance(self.llm, EmbeddingInputs):
            self.task = EMBED
            self.embeddings = EmbeddingService(self.llm, self.model_name, self.metrics)
        else:
            self.task = GENERATE
            self.loop = EngineLoop(self.llm.engine, self.metrics)
            self.backend = ServingBackend(self.llm, self.loop, self.model_name, max_tokens_limit=self.max_tokens_limit)
        self.files = FileStore(self.state_dir, self.clock)
        self.batches = BatchManager(self.state_dir, self.files, self._batch_backend, self.model_name,
                                    functools.partial(self.check_serves, param="endpoint"), self.clock)

    def _batch_backend(self, batch_id: str, endpoint: str) -> Backend:
        if self.embeddings is not None:
            return self.embeddings.batch_backend()
        assert self.loop is not None
        return ServingBackend(self.llm, self.loop, self.model_name,  # type: ignore[arg-type]
                              batch_id=batch_id, endpoint=endpoint, max_tokens_limit=self.max_tokens_limit)

    def start(self) -> None:
        if self.loop:
            self.loop.start()
        self.batches.start()

    def close(self) -> None:
        self.batches.close()  # first: its in-flight requests are aborted through the loop
        if self.loop:
            self.loop.stop()
        for part in (self.backend, self.embeddings):
            if part:
                part.close()

    @property
    def alive(self) -> bool:
        """Whether the model still answers (/health)."""
        return self.loop.alive if self.loop else bool(self.embeddings and self.embeddings.alive)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist (this server serves `{self.model_name}`)",
                           param="model", code="model_not_found")

    def check_serves(self, url: str, param: str = "model") -> None:
        """A 400 for an endpoint the model is not for (`param`: the field that asked for it)."""
        if url not in self.task.urls:
            raise bad_request(f"`{self.model_name}` is {self.task.model_is}: this server answers "
                              f"{' and '.join(self.task.urls)}, not {url}", param=param)

    def model_object(self) -> dict[str, Any]:
        """OpenAI's model object, with vLLM's max_model_len, what the model is for (`task`, as vLLM
        calls it) and, for an embedding model, the vectors' size."""
        obj = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "tokenmill",
               "task": self.task.name}
        if self.embeddings is not None:
            return {**obj, "max_model_len": self.embeddings.embedder.max_model_len,
                    "dimensions": self.embeddings.embedder.dimensions}
        return {**obj, "max_model_len": self.llm.engine.max_model_len}  # type: ignore[union-attr]
