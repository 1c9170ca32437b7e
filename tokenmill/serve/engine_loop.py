"""The one thread that owns the engine.

An engine (`StepEngine`: the embedded one or vLLM's) is not thread-safe, so every call into it
after start-up (add, step, abort) happens here. Other threads send commands through a queue;
each request's outputs go to the callback it was added with (the HTTP layer wraps it in
`loop.call_soon_threadsafe`, the batch runner in a thread queue). While there is work the thread
steps the engine back to back (continuous batching across all clients); when idle it sleeps on
the queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.engine import EngineRequest, FinishReason, RequestOutput, SchedulerMetrics, StepEngine
from tokenmill.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)

# Called on the engine thread with each new output of a request, or with the exception that
# ended it (an engine failure). Must be quick and must not call into the engine.
OutputCallback = Callable[[RequestOutput | Exception], None]


@dataclass
class _Tracked:
    on_output: OutputCallback
    last_token_at: float | None = None
    num_tokens: int = 0


@dataclass
class EngineLoop:
    engine: StepEngine
    metrics: ServeMetrics
    _commands: queue.Queue = field(default_factory=queue.Queue, init=False)
    _tracked: dict[str, _Tracked] = field(default_factory=dict, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    snapshot: SchedulerMetrics | None = field(default=None, init=False)  # for /metrics, read lock-free

    # ---- any thread ---------------------------------------------------------------------------
    def start(self) -> None:
        self._snapshot()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    def add(self, request: EngineRequest, on_output: OutputCallback) -> None:
        """`request` comes from `engine.process_request` (validated, no engine state touched)."""
        self._commands.put(("add", request, on_output))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))

    def stop(self) -> None:
        """Abort everything in flight and end the thread."""
        if self._thread is not None:
            self._commands.put(("stop", None, None))
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            # Block only when idle: a busy engine just picks up what arrived since the last step.
            if not self._drain(block=not self._tracked):
                break
            if self._tracked:
                self._step()
        for request_id in list(self._tracked):
            self._abort(request_id)

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; returns False on stop."""
        try:
            command = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, arg, callback = command
            if kind == "stop":
                return False
            if kind == "add":
                self._add(arg, callback)
            else:
                self._abort(arg)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                # An abort frees KV blocks now, and an engine left idle by it steps no more: without
                # this snapshot /metrics would show the aborted request running until the next step.
                self._snapshot()
                return True

    def _add(self, request: EngineRequest, on_output: OutputCallback) -> None:
        if request.request_id in self._tracked:  # a client reusing an id must not hijack another's stream
            on_output(ValueError(f"request id {request.request_id!r} is already in use"))
            return
        try:
            self.engine.add_processed(request)
        except Exception as exc:  # that request fails (a 500, a batch line's server_error), not this thread
            log.exception("engine failed to add request %r", request.request_id)
            on_output(exc)
            return
        self._tracked[request.request_id] = _Tracked(on_output)

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        out = self.engine.abort_request(request_id)
        if tracked is not None and out is not None:
            self._finished(out)
            tracked.on_output(out)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # an engine bug must not take the server down: fail what was running
            log.exception("engine step failed; failing %d request(s)", len(self._tracked))
            for request_id, tracked in list(self._tracked.items()):
                self._tracked.pop(request_id)
                self.engine.abort_request(request_id)
                tracked.on_output(exc)
            outputs = []
        self._snapshot()  # before the outputs go out: what a client has seen, /metrics already shows
        now = time.monotonic()
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            self._observe_token(tracked, out, now)
            if out.finished:
                del self._tracked[out.request_id]
                self._finished(out)
            tracked.on_output(out)

    def _observe_token(self, tracked: _Tracked, out: RequestOutput, now: float) -> None:
        m = self.metrics
        if tracked.last_token_at is None and out.timings.first_token is not None:
            m.time_to_first_token.observe(out.timings.first_token - out.timings.arrival)
        elif tracked.last_token_at is not None:
            # A step with verified drafts brings several tokens at once: each gets its share of the gap.
            new = max(1, out.num_output_tokens - tracked.num_tokens)
            for _ in range(new):
                m.inter_token_latency.observe((now - tracked.last_token_at) / new)
        m.generation_tokens.inc(out.num_output_tokens - tracked.num_tokens)
        tracked.last_token_at, tracked.num_tokens = now, out.num_output_tokens

    def _finished(self, out: RequestOutput) -> None:
        m = self.metrics
        m.prompt_tokens.inc(out.num_prompt_tokens)
        m.requests_finished.labels(finish_reason=out.finish_reason or FinishReason.ABORT).inc()
        m.e2e_latency.observe(time.monotonic() - out.timings.arrival)

    def _snapshot(self) -> None:
        self.snapshot = self.engine.metrics()  # its own copy: /metrics never reads counters mid-update

