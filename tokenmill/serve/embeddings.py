"""`/v1/embeddings` on a server whose model is an embedding model (`EmbeddingInputs`), live and through the Batch API.

One thread runs the embedder, tokenizing and forwards alike: a forward already uses every core,
and a Hugging Face tokenizer must not be called from two threads at once (truncation changes its
state). Live requests that arrive while a forward runs are embedded together in the next one; a
batch takes its turn a window of rows at a time, so a live request waits for one window at most.
Bodies and response bodies are openai_compat's, as in a `tokenmill run` job.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tokenmill.embed.config import EmbeddingConfig
from tokenmill.jobs.backends import EmbeddingBackend
from tokenmill.jobs.input import BatchRequest
from tokenmill.openai_compat import EmbeddingRequest, embedding_inputs, embedding_response_body
from tokenmill.serve.backend import check_body_model
from tokenmill.serve.errors import APIError

if TYPE_CHECKING:
    import numpy as np

    from tokenmill.embed.inputs import EmbeddingInputs
    from tokenmill.serve.metrics import ServeMetrics


# Inputs a Batch API batch embeds per turn on the embedding thread: about 100 ms of forwards on
# a few CPU cores for short texts, which is what a live request may have to wait behind.
BATCH_WINDOW_INPUTS = 256


class EmbeddingService:
    def __init__(self, embedder: EmbeddingInputs, model: str, metrics: ServeMetrics | None = None) -> None:
        """`model`: the served model name, which every response names."""
        self.embedder, self.model, self.metrics = embedder, model, metrics
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-embed")
        self._waiting: list[tuple[list[list[int]], asyncio.Future[np.ndarray]]] = []
        self._forwards: asyncio.Task[None] | None = None
        self.alive = True

    def close(self) -> None:
        self.alive = False
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def respond(self, request: EmbeddingRequest) -> dict[str, Any]:
        """The response body; RequestError (a 400) for an input the model cannot embed as asked."""
        start = time.monotonic()
        ids = await asyncio.get_running_loop().run_in_executor(self._thread, embedding_inputs, request, self.embedder)
        try:
            vectors = await self._embed(ids)
        except Exception as exc:
            raise APIError(500, f"the embedding model failed on this request: {exc}", type="server_error") from None
        prompt_tokens = sum(map(len, ids))
        if self.metrics is not None:
            self.metrics.embedding_request_finished(prompt_tokens, time.monotonic() - start)
        return embedding_response_body(request, self.embedder.shorten(vectors, request.dimensions), self.model,
                                       prompt_tokens)

    async def _embed(self, ids: list[list[int]]) -> np.ndarray:
        done: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self._waiting.append((ids, done))
        if self._forwards is None or self._forwards.done():
            self._forwards = asyncio.create_task(self._run_forwards())
        return await done

    async def _run_forwards(self) -> None:
        """Embed everything waiting in one call, until nothing waits. A task of its own: a client
        that goes away cancels its wait, never the forward the others share."""
        aio = asyncio.get_running_loop()
        while self._waiting:
            taken, self._waiting = self._waiting, []
            try:
                vectors = await aio.run_in_executor(self._thread, self.embedder.embed_token_ids,
                                                    [seq for ids, _ in taken for seq in ids])
            except Exception as exc:
                for _, done in taken:
                    if not done.done():
                        done.set_exception(exc)
                continue
            at = 0
            for ids, done in taken:
                if not done.done():  # cancelled: its client went away
                    done.set_result(vectors[at:at + len(ids)])
                at += len(ids)

    def batch_backend(self) -> BatchEmbeddingBackend:
        return BatchEmbeddingBackend(self.model, _OnThread(self.embedder, self._thread.submit))


class BatchEmbeddingBackend(EmbeddingBackend):
    """A Batch API batch on the server's embedder (`tokenmill run`'s embedding backend, taking turns
    with live requests); its lines must name the served model, as a generation batch's do."""

    def __init__(self, model: str, embedder: Any) -> None:
        super().__init__(EmbeddingConfig(sort_window=BATCH_WINDOW_INPUTS), embedder=embedder)
        self.model = model  # the served name, not the folder's: what the live answers say

    def check(self, request: BatchRequest) -> None:
        super().check(request)
        check_body_model(request.body, self.model)


class _OnThread:
    """The embedder as a batch's backend calls it from the Batch API's thread: each method runs on
    the embedding thread, in turn with live requests, and the caller waits for it."""

    def __init__(self, embedder: EmbeddingInputs, submit: Callable[..., Any]) -> None:
        self._embedder, self._submit = embedder, submit

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._embedder, name)
        if not callable(value):  # dimensions, name, stats: read as they are
            return value
        return lambda *args: self._submit(value, *args).result()
