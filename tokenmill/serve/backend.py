"""The bridge between OpenAI request bodies and the server's shared engine loop.

Live requests use `prepare` + `stream`; the Batch API hands a `ServingBackend` to `run_job` like
any other job backend. Bodies become prompts and response bodies through openai_compat, as in a
`tokenmill run` job, so a live request and a batch line give the same answer.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tokenmill.engine import EngineRequest, FinishReason, InProcessModel, RequestOutput
from tokenmill.jobs.backends import BackendStats, ResultSink, StopFlag
from tokenmill.jobs.input import BatchRequest
from tokenmill.jobs.results import ErrorCode
from tokenmill.openai_compat import (
    LiveRequest,
    OpenAIRequest,
    RequestError,
    check_structured_outputs,
    engine_inputs,
    response_body,
    token_decoder,
)
from tokenmill.serve.engine_loop import EngineLoop

log = logging.getLogger(__name__)

LIVE_PRIORITY, BATCH_PRIORITY = 0, 1  # under the "priority" policy live traffic goes first
# Threads that tokenize live requests (and render their chat templates). Tokenizing a long prompt
# takes a while (about a second per MB); on the event loop it would stall every other client, every
# stream and /health. Two lanes, so that short prompts pass long ones: first come, first served
# on one pool, a 2-token request waited behind four 1.3 MB prompts for 4.6 s. Long prompts queue
# on their own threads; a short one goes to a thread no long prompt may take, and is tokenized in
# milliseconds whatever is queued behind the long lane.
TOKENIZER_THREADS = 2  # the long lane
SHORT_PROMPT_THREADS = 1  # the short lane
SHORT_PROMPT_CHARS = 32_768  # ~8k tokens: tens of milliseconds to tokenize


@dataclass
class Prepared:
    request: BatchRequest | LiveRequest
    engine_request: EngineRequest


def prompt_chars(body: dict[str, Any]) -> int:
    """What there is to tokenize in a body, in characters, before it is checked: the prompt's text
    (token ids count one each), or every message's. Counted on the event loop, so it looks at no
    more than the fields; a body of another shape counts as long (the long lane checks it)."""
    def size(value: Any) -> int:
        if isinstance(value, str):
            return len(value)
        if isinstance(value, list):  # token ids are counted by the list's length, not one by one
            return sum(size(item) for item in value) if value and isinstance(value[0], (str, list, dict)) \
                else len(value)
        if isinstance(value, dict):  # a content part ({"type": "text", "text": ...})
            return size(value.get("text"))
        return 1

    if "messages" in body and isinstance(body["messages"], list):
        return sum(size(m.get("content")) if isinstance(m, dict) else 1 for m in body["messages"])
    if "prompt" in body:
        return size(body["prompt"])
    return SHORT_PROMPT_CHARS + 1


def check_body_model(body: dict[str, Any], served: str) -> None:
    """A body naming another model than the served one is refused (RequestError): a Batch API
    line's model reaches no route's check."""
    model = body.get("model")
    if model is not None and model != served:
        raise RequestError(f"body.model {model!r} is not served here (this server serves {served!r})", "model")


class ServingBackend:
    kind = "serve"

    def __init__(self, llm: InProcessModel, loop: EngineLoop, model: str, *, batch_id: str = "",
                 endpoint: str = "", max_tokens_limit: int | None = None) -> None:
        """`batch_id`, `endpoint`: set for a Batch API job (its lines must all use that endpoint).
        `max_tokens_limit`: the most tokens one request may ask for (`serve --max-tokens-limit`)."""
        self.llm, self.loop, self.model = llm, loop, model
        self.batch_id, self.endpoint = batch_id, endpoint
        self.max_tokens_limit = max_tokens_limit
        self.window = llm.engine.max_num_seqs  # batch requests in the engine at once: a full batch
        self._token_text = token_decoder(llm.tokenizer)  # how logprobs show a token
        self._tokenizers = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenmill-tokenize")
        self._short_tokenizers = ThreadPoolExecutor(SHORT_PROMPT_THREADS, thread_name_prefix="tokenmill-tokenize-short")

    def check(self, request: BatchRequest | LiveRequest, parsed: OpenAIRequest | None = None) -> None:
        """A Batch API line (`request.parsed`: its fields were checked as it was read), or a live
        request's body as `prepare` parsed it. Raises RequestError, whatever goes wrong."""
        with _refused_alone(request):
            if self.endpoint and request.url != self.endpoint:
                raise RequestError(f"url {request.url!r} differs from the batch's endpoint {self.endpoint!r}")
            parsed = request.parsed if parsed is None else parsed  # first: broken text is named as such
            check_body_model(request.body, self.model)
            self._hold_to_max_tokens_limit(request.body, parsed)
            check_structured_outputs(parsed, self.llm)  # a Batch API line's bad schema: refused up front

    def _hold_to_max_tokens_limit(self, body: dict[str, Any], parsed: OpenAIRequest) -> None:
        """A request asking for more tokens than the operator's limit is refused, naming it: clamping
        it would hand back a shorter answer than asked for, which a client could take for a whole
        one. One that asks for no number gets the default, held to the limit."""
        limit = self.max_tokens_limit
        if limit is None:
            return
        field = next((name for name in ("max_completion_tokens", "max_tokens") if body.get(name)), None)
        if field is not None and body[field] > limit:
            raise RequestError(f"body.{field} = {body[field]} is over this server's limit of {limit} tokens a "
                               f"request (tokenmill serve --max-tokens-limit): ask for at most {limit}", field)
        parsed.params.max_tokens = min(parsed.params.max_tokens, limit)

    # ---- one request ----------------------------------------------------------------------------
    def prepare(self, request: BatchRequest | LiveRequest, priority: int = LIVE_PRIORITY,
                parsed: OpenAIRequest | None = None) -> Prepared:
        """Validate and tokenize; raises ValueError (a 400) naming the problem. Touches no engine state.
        (A text prompt far too long for the context is refused by its length, before tokenizing: the
        engine checks it in `chat_token_ids` and `process_request`.) `parsed`: a Batch API line's
        body as its reading parsed it; a live body is parsed here, every field checked, once."""
        with _refused_alone(request):
            parsed = parsed or request.parsed
            self.check(request, parsed)
            prompt, params = engine_inputs(parsed, self.llm)
            if params.seed is None:  # drawn here: the engine's own seed generator belongs to its thread
                params.seed = random.getrandbits(62)
            return Prepared(request, self.llm.engine.process_request(prompt, params, request.custom_id, priority))

    async def prepare_off_loop(self, request: LiveRequest) -> Prepared:
        """`prepare` for a live request, on a tokenizer thread of its lane (see TOKENIZER_THREADS)."""
        short = prompt_chars(request.body) <= SHORT_PROMPT_CHARS
        lane = self._short_tokenizers if short else self._tokenizers
        return await asyncio.get_running_loop().run_in_executor(lane, self.prepare, request)

    def close(self) -> None:
        self._tokenizers.shutdown(wait=False, cancel_futures=True)
        self._short_tokenizers.shutdown(wait=False, cancel_futures=True)

    def response_body(self, prepared: Prepared, out: RequestOutput) -> dict[str, Any]:
        return response_body(prepared.request.url, out, self.model, prepared.request.custom_id,
                             token_text=self._token_text)

    async def stream(self, prepared: Prepared) -> RequestStream:
        stream = RequestStream(self.loop, prepared.engine_request.request_id, asyncio.get_running_loop())
        self.loop.add(prepared.engine_request, stream.push)
        return stream

    # ---- the Batch API: the job runner's backend interface ----------------------------------------
    def start(self) -> None:
        """Nothing to load: the engine is the server's."""

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        done: queue.Queue[tuple[BatchRequest, RequestOutput | Exception]] = queue.Queue()
        inflight: dict[str, BatchRequest] = {}
        exhausted = False
        while True:
            if stop.requested:  # cancel or shutdown: unfinished lines stay unwritten, so a re-run does them
                for request_id in inflight:
                    self.loop.abort(request_id)
                break
            while not exhausted and len(inflight) < self.window:
                request = next(requests, None)
                exhausted = request is None
                if request is not None:
                    self._submit(request, inflight, done, sink)
            if not inflight:
                break
            try:
                request, out = done.get(timeout=0.2)
            except queue.Empty:
                continue
            inflight.pop(self._request_id(request), None)
            if isinstance(out, Exception):
                sink.error(request, ErrorCode.SERVER_ERROR, f"engine failure: {out}")
            elif out.finish_reason != FinishReason.ABORT:
                sink.result(request, response_body(request.url, out, self.model, token_text=self._token_text))
        return BackendStats()  # the engine is shared: per-job prefill/decode times mean nothing here

    def _submit(self, request: BatchRequest, inflight: dict[str, BatchRequest], done: queue.Queue,
                sink: ResultSink) -> None:
        request_id = self._request_id(request)
        keyed = BatchRequest(request.line, request_id, request.url, request.body)
        try:
            prepared = self.prepare(keyed, BATCH_PRIORITY, request.parsed)
        except ValueError as exc:  # e.g. longer than the context: final, like the embedded backend
            sink.error(request, ErrorCode.INVALID_REQUEST, str(exc))
            return

        def finished(out: RequestOutput | Exception) -> None:
            if isinstance(out, Exception) or out.finished:
                done.put((request, out))

        inflight[request_id] = request
        self.loop.add(prepared.engine_request, finished)

    def _request_id(self, request: BatchRequest) -> str:
        return f"{self.batch_id}:{request.custom_id}"


@contextmanager
def _refused_alone(request: BatchRequest | LiveRequest) -> Iterator[None]:
    """Whatever checking or tokenizing one request raises is that request's refusal (a RequestError:
    a 400 live, its error row in a batch), never a 500 or the whole batch failed: a body no check
    foresaw is still only that body's problem. Logged with its traceback, since no check caught it."""
    try:
        yield
    except ValueError:  # a RequestError, or the engine's refusal (too long for the context, ...)
        raise
    except Exception as exc:
        log.exception("request %r: unexpected error while checking or tokenizing it", request.custom_id)
        raise RequestError(f"this request could not be checked or tokenized: {type(exc).__name__}: {exc}") from exc


class RequestStream:
    """One live request's outputs on the event loop. Only the latest output matters (its `text`
    is the whole text so far), so pushes coalesce and a slow reader never builds a backlog."""

    def __init__(self, loop: EngineLoop, request_id: str, aio: asyncio.AbstractEventLoop) -> None:
        self._loop, self.request_id, self._aio = loop, request_id, aio
        self._latest: RequestOutput | Exception | None = None
        self._event = asyncio.Event()
        self.finished = False

    def push(self, out: RequestOutput | Exception) -> None:  # engine thread
        self._aio.call_soon_threadsafe(self._set, out)

    def _set(self, out: RequestOutput | Exception) -> None:
        self._latest = out
        self._event.set()

    async def next(self, timeout: float) -> RequestOutput | None:
        """The newest output, or None after `timeout` s without one (to check the client is there)."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            return None
        self._event.clear()
        out, self._latest = self._latest, None
        if isinstance(out, Exception):
            self.finished = True
            raise out
        assert out is not None
        self.finished = out.finished
        return out

    def abort(self) -> None:
        """Free the request's KV blocks unless it already finished (a client went away)."""
        if not self.finished:
            self.finished = True
            self._loop.abort(self.request_id)
