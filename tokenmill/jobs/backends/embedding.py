"""The in-process embedding backend: `/v1/embeddings` rows through an embedding model in this
process (tokenmill's `Embedder`, or vLLM's pooling runner: engines.py `load_embedder`).

Rows are taken a window at a time (up to the spec's `sort_window` inputs), every input of the
window is embedded in length-sorted batches (embed/batching.py), and each row is written once all
of its inputs have their vectors. A stop (Ctrl-C) ends the job after the window in hand; a kill
loses at most that window, which a re-run does again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from tokenmill.embed.config import EmbeddingConfig
from tokenmill.engines import EmbeddingSpec
from tokenmill.environment import DEFAULT_EMBEDDING_MODEL, model_name
from tokenmill.jobs.backends.base import BackendStats, BackendUnavailable, ResultSink, StopFlag
from tokenmill.jobs.input.request import BatchRequest
from tokenmill.jobs.journal.rows import ErrorCode
from tokenmill.openai_compat import EMBEDDINGS_URL, RequestError, embedding_inputs, embedding_response_body

if TYPE_CHECKING:
    from tokenmill.embed.inputs import EmbeddingInputs


class EmbeddingBackend:
    kind = "embedding"

    def __init__(self, spec: EmbeddingSpec | None = None, *, embedder: EmbeddingInputs | None = None) -> None:
        """`spec`: the model to load in `start`; `embedder`: one already loaded instead (tests)."""
        self.spec = spec or EmbeddingConfig()
        self._embedder = embedder
        self._owns_embedder = embedder is None  # one handed in is its owner's to close
        self.model = model_name(self.spec.model or DEFAULT_EMBEDDING_MODEL)
        self._load_s = 0.0

    def check(self, request: BatchRequest) -> None:
        if request.url != EMBEDDINGS_URL:
            raise ValueError(f"{self.model} is an embedding model: it answers {EMBEDDINGS_URL} rows, "
                             f"not {request.url}")
        request.embedding  # noqa: B018 (the body's rules, checked once)

    def start(self) -> None:
        if self._embedder is None:
            start = time.monotonic()
            from tokenmill.engines import load_embedder

            try:
                self._embedder = load_embedder(self.spec)
            except (ValueError, FileNotFoundError) as exc:  # not an encoder, not there: no line's fault
                raise BackendUnavailable(str(exc)) from exc
            self._load_s = time.monotonic() - start

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        assert self._embedder is not None, "start() first"
        embedder = self._embedder
        tokens0, seconds0 = embedder.stats.tokens, embedder.stats.seconds
        while not stop.requested:
            window = self._window(requests, sink)
            if window is None:
                break
            self._embed(window, sink)
        load_s, self._load_s = self._load_s, 0.0
        return BackendStats(load_s=load_s, prefill_tokens=embedder.stats.tokens - tokens0,
                            prefill_s=embedder.stats.seconds - seconds0, decode_tokens=0, decode_s=0.0,
                            num_preemptions=0)

    def close(self) -> None:
        """Let go of the model this backend loaded (vLLM's processes stop now)."""
        if self._owns_embedder and self._embedder is not None:
            self._embedder.close()
            self._embedder = None

    def _window(self, requests: Iterator[BatchRequest], sink: ResultSink
                ) -> list[tuple[BatchRequest, list[list[int]]]] | None:
        """The next rows with their inputs as token ids, up to a sort window of inputs; a row the
        model cannot embed (too long, an id outside the vocabulary) goes to the errors file.
        None once `requests` is exhausted."""
        assert self._embedder is not None
        window: list[tuple[BatchRequest, list[list[int]]]] = []
        inputs, exhausted = 0, False
        while inputs < self.spec.sort_window:
            request = next(requests, None)
            if request is None:
                exhausted = True
                break
            try:
                ids = embedding_inputs(request.embedding, self._embedder)
            except RequestError as exc:
                sink.error(request, ErrorCode.INVALID_REQUEST, str(exc))
                continue
            window.append((request, ids))
            inputs += len(ids)
        return None if exhausted and not window else window

    def _embed(self, window: list[tuple[BatchRequest, list[list[int]]]], sink: ResultSink) -> None:
        assert self._embedder is not None
        vectors = self._embedder.embed_token_ids([ids for _, row in window for ids in row])
        at = 0
        for request, ids in window:
            mine = self._embedder.shorten(vectors[at:at + len(ids)], request.embedding.dimensions)
            at += len(ids)
            body = embedding_response_body(request.embedding, mine, self.model, sum(map(len, ids)))
            sink.result(request, body)
