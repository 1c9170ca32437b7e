"""The in-process backend: the whole job fed to a continuous-batching engine in this process, the
embedded one or vLLM's (a `VllmConfig` spec, driven through the same interface: vllm_engine/).

A bounded window of requests sits inside the engine (`window_factor` × max_num_seqs, waiting
plus running) and is topped up as requests finish: the scheduler always has a full batch to
pick from, while a million-line file is never tokenized into memory at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from tokenmill.engine import EngineConfig, EngineSpec, FinishReason, InProcessModel, RequestOutput, StepEngine
from tokenmill.engines import load_engine
from tokenmill.environment import model_name
from tokenmill.jobs.backends.base import BackendStats, BackendUnavailable, ResultSink, StopFlag
from tokenmill.jobs.input.request import BatchRequest
from tokenmill.jobs.journal.rows import ErrorCode
from tokenmill.openai_compat import (
    check_prompt_size,
    check_structured_outputs,
    engine_inputs,
    response_body,
    token_decoder,
)

if TYPE_CHECKING:
    from tokenmill.models.loader import LoadedWeights


class EmbeddedBackend:
    def __init__(
        self, spec: EngineSpec | None = None, *, llm: InProcessModel | None = None,
        weights: LoadedWeights | None = None,
        window_factor: int = 2, load_to_check: bool = True,
    ) -> None:
        """`spec`: the engine to load in `start` (the embedded one by default, or vLLM's with a
        `VllmConfig`), on `weights` when they are already loaded (they travel with the backend
        to Ray replicas); `llm`: an engine already loaded instead (tests share one model load).

        `load_to_check`: `check` loads the engine, so that validation refuses a prompt too long
        for its context (by a length bound, without tokenizing), or a structured output that does
        not compile, before any work. Off on a Ray driver (`check_without_loading`): there a
        replica's engine refuses it as cheaply."""
        self.spec: EngineSpec = spec or EngineConfig()
        self._llm: InProcessModel | None = llm
        self._owns_llm = llm is None  # one handed in is its owner's to close
        self._weights, self._load_to_check = weights, load_to_check
        self._load_s = 0.0
        self.kind = llm.engine.name if llm else self.spec.engine
        self.model = model_name(llm.engine.model if llm else self.spec.model)
        # Set again in `start` from the engine's batch (vLLM's default is known once it is loaded).
        self._window_factor = window_factor
        self.window = self._window(llm.engine.max_num_seqs if llm else self.spec.max_num_seqs)

    # ---- validation (before any work) -------------------------------------------------------
    def check(self, request: BatchRequest) -> None:
        parsed = request.parsed  # the body's rules, checked once
        if self._load_to_check:
            try:
                self.start()
            except ValueError as exc:  # e.g. an unsupported model: no line's fault
                raise BackendUnavailable(str(exc)) from exc
            assert self._llm is not None
            check_prompt_size(parsed, self._llm)
            check_structured_outputs(parsed, self._llm)  # compiled once per distinct setting

    def check_without_loading(self) -> None:
        self._load_to_check = False

    # ---- running ------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the engine (once: `check` may have done it already)."""
        if self._llm is None:
            start = time.monotonic()
            self._llm = load_engine(self.spec, self._weights)
            self._load_s = time.monotonic() - start
            self.window = self._window(self._llm.engine.max_num_seqs)

    def _window(self, max_num_seqs: int | None) -> int:
        return max(1, self._window_factor * (max_num_seqs or EngineConfig.max_num_seqs))

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        assert self._llm is not None, "start() first"
        engine = self._llm.engine
        token_text = token_decoder(self._llm.tokenizer)  # for rows that ask for logprobs
        timer = _StepTimer()
        stats0 = engine.stats()
        inflight: dict[str, BatchRequest] = {}
        exhausted = False
        while True:
            if stop.requested:
                self._abort(inflight, everything=stop.forced)
            elif not exhausted:
                exhausted = self._top_up(requests, inflight, sink)
            if not inflight:
                break
            for out in timer.step(engine):
                if out.finished and out.request_id in inflight:
                    request = inflight.pop(out.request_id)
                    if out.finish_reason is FinishReason.ERROR:  # refused inside the engine (vLLM, on submission)
                        message = out.error or f"refused by the {self.kind} engine"
                        sink.error(request, ErrorCode.INVALID_REQUEST, message)
                    else:
                        sink.result(request, response_body(request.url, out, self.model, token_text=token_text))
        load_s, self._load_s = self._load_s, 0.0  # counted once, in the run after the load
        now = engine.stats()
        drafts = now.num_draft_tokens - stats0.num_draft_tokens
        return BackendStats(
            load_s=load_s, prefill_tokens=timer.prefill_tokens, decode_tokens=timer.decode_tokens,
            prefill_s=timer.prefill_s, decode_s=timer.decode_s,
            num_preemptions=now.num_preemptions - stats0.num_preemptions,
            num_drafts=now.num_drafts - stats0.num_drafts if drafts else None,
            num_draft_tokens=drafts or None,
            num_accepted_tokens=now.num_accepted_tokens - stats0.num_accepted_tokens if drafts else None,
        )

    def close(self) -> None:
        """Let go of the engine this backend loaded (vLLM's processes stop now)."""
        if self._owns_llm and self._llm is not None:
            self._llm.engine.close()
            self._llm = None

    def share_machine(self, share: float) -> None:
        """Before `start`: this engine runs beside others on one machine (Ray replicas) and gets
        `share` (0–1] of it (see `EngineSpec.for_share_of_machine`)."""
        self.spec = self.spec.for_share_of_machine(share)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop these requests from the engine, e.g. after `run` raised half-way through them."""
        if self._llm is not None:
            for request_id in request_ids:
                self._llm.engine.abort_request(request_id)

    def _top_up(self, requests: Iterator[BatchRequest], inflight: dict[str, BatchRequest], sink: ResultSink) -> bool:
        """Fill the window; returns True once `requests` is exhausted."""
        assert self._llm is not None
        while len(inflight) < self.window:
            request = next(requests, None)
            if request is None:
                return True
            try:
                prompt, params = engine_inputs(request.parsed, self._llm)
                self._llm.engine.add_request(prompt, params, request.custom_id)
            except (ValueError, TypeError) as exc:  # e.g. longer than the context
                sink.error(request, ErrorCode.INVALID_REQUEST, str(exc) if isinstance(exc, ValueError)
                           else f"{type(exc).__name__}: {exc}")
                continue
            inflight[request.custom_id] = request
        return False

    def _abort(self, inflight: dict[str, BatchRequest], everything: bool) -> None:
        """Stop: drop what has not started (or everything, on a second signal); not written, so
        a re-run does them. Requests already computing run to the end."""
        assert self._llm is not None
        engine = self._llm.engine
        for request_id in list(inflight):
            if everything or not engine.has_started(request_id):
                engine.abort_request(request_id)
                del inflight[request_id]


class _StepTimer:
    """Runs engine steps and splits their time into prefill and decode (see summary.py)."""

    def __init__(self) -> None:
        self.prefill_tokens = self.decode_tokens = 0
        self.prefill_s = self.decode_s = 0.0

    def step(self, engine: StepEngine) -> list[RequestOutput]:
        before = engine.stats()
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        after = engine.stats()
        prefill, decode = after.prefill_tokens - before.prefill_tokens, after.decode_tokens - before.decode_tokens
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        # A step that does both counts in both: each rate is "tokens of that kind per second of
        # the steps that computed any", so mixed steps make both rates lower bounds.
        if prefill:
            self.prefill_s += elapsed
        if decode:
            self.decode_s += elapsed
        return outputs
