"""`/v1/completions` and `/v1/chat/completions`: OpenAI bodies in, engine outputs back as JSON
or server-sent events; and `/v1/embeddings` (embeddings.py runs it). Validation, prompts and
response bodies are openai_compat's, as for a batch job; this module adds what only a live
connection has: streaming deltas and client disconnects."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, WithJsonSchema, create_model
from starlette.types import Receive, Scope, Send

from tokenmill.engine import RequestOutput
from tokenmill.openai_compat import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    BodyField,
    LiveRequest,
    RequestError,
    body_fields,
    check_text,
    new_response_id,
    parse_embedding_request,
    usage,
)
from tokenmill.serve.backend import Prepared, RequestStream
from tokenmill.serve.errors import APIError, bad_request, from_value_error
from tokenmill.serve.state import ServeState

DISCONNECT_POLL_S = 0.5  # how often a live request checks that its client is still there
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but the log says what happened


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # other fields reach the backend's checks, which refuse
    # what would change the answer (tools, logit_bias, ...) and ignore the rest (user, metadata, ...)
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None


class _CompletionFields(_Body):
    # StrictInt: `true` is no token id (as in a batch line), not token 1
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]]


class _ChatFields(_Body):
    messages: list[ChatMessage] = Field(min_length=1)


class _EmbeddingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # `user` and the like, which openai_compat ignores
    model: str


def _with_body_fields(name: str, base: type[BaseModel], fields: tuple[BodyField, ...],
                      required: tuple[str, ...] = ()) -> Any:
    """`base` with the endpoint's body fields (openai_compat.body_fields: its sampling and
    structured-output fields, or the embedding ones): described in the schema as the tables write them,
    and checked once, by the tables' checks, as a batch line is, with the same messages (so not
    here: a value of any type reaches them). `required`: those a body must have."""
    declared: dict[str, Any] = {f.name: (Annotated[Any, WithJsonSchema(f.schema)], ... if f.name in required else None)
                                for f in fields}
    return create_model(name, __base__=base, **declared)


CompletionBody = _with_body_fields("CompletionBody", _CompletionFields, body_fields(COMPLETIONS_URL))
ChatBody = _with_body_fields("ChatBody", _ChatFields, body_fields(CHAT_URL))
EmbeddingBody = _with_body_fields("EmbeddingBody", _EmbeddingFields, body_fields(EMBEDDINGS_URL), required=("input",))
# A completion with `"stream": true` answers in server-sent events, not JSON.
EVENT_STREAM = {200: {"description": "the completion: JSON, or server-sent events with `stream`",
                      "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


# Handled here (streaming), or OpenAI fields that do not change the answer.
IGNORED_FIELDS = {"stream", "stream_options", "user", "metadata", "store", "service_tier"}


def router(state: ServeState) -> APIRouter:
    api = APIRouter()

    @api.post(COMPLETIONS_URL, responses=EVENT_STREAM)
    async def completions(body: CompletionBody, request: Request) -> Any:  # type: ignore[valid-type]
        state.check_serves(COMPLETIONS_URL)
        data = _engine_fields(body)
        data["prompt"] = _one_prompt(body.prompt)
        return await _serve(state, request, body, LiveRequest(new_response_id(COMPLETIONS_URL), COMPLETIONS_URL, data))

    @api.post(CHAT_URL, responses=EVENT_STREAM)
    async def chat_completions(body: ChatBody, request: Request) -> Any:  # type: ignore[valid-type]
        state.check_serves(CHAT_URL)
        live = LiveRequest(new_response_id(CHAT_URL), CHAT_URL, _engine_fields(body))
        return await _serve(state, request, body, live)

    @api.post(EMBEDDINGS_URL)
    async def embeddings(body: EmbeddingBody) -> dict[str, Any]:  # type: ignore[valid-type]
        state.check_serves(EMBEDDINGS_URL)
        try:
            # Every field's text checked before check_model quotes a value back, as in _engine_fields.
            parsed = parse_embedding_request(body.model_dump(exclude_none=True))
            state.check_model(body.model)
            assert state.embeddings is not None  # check_serves: an embedding model
            return await state.embeddings.respond(parsed)
        except RequestError as exc:  # a bad field, or an input the model cannot embed as asked
            raise from_value_error(exc) from None

    return api


def _engine_fields(body: _Body) -> dict[str, Any]:
    """The body as the backend reads it, less the fields handled here or ignored. Every field's text
    is checked first, the ignored ones' too, and before anything (the 404 for an unknown model)
    quotes a value back: a lone surrogate anywhere is a 400 naming where, as in a batch line."""
    data = body.model_dump(exclude_none=True)
    try:
        check_text(data)
    except RequestError as exc:
        raise from_value_error(exc) from None
    return {name: value for name, value in data.items() if name not in IGNORED_FIELDS}


def _one_prompt(prompt: Any) -> Any:
    """One prompt per request: a string or token ids (a list holding one of them is unwrapped)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(f"prompt: {len(prompt)} prompts in one request; send one request per prompt",
                              param="prompt")
        return prompt[0]
    return prompt


async def _serve(state: ServeState, request: Request, body: _Body, req: LiveRequest) -> Any:
    state.check_model(body.model)
    assert state.backend is not None  # check_serves: a generation model
    try:
        prepared = await state.backend.prepare_off_loop(req)
    except ValueError as exc:  # too long for the context, bad sampling values, unsupported fields
        raise from_value_error(exc) from None
    if body.stream and prepared.engine_request.params.logprobs is not None:
        # A stream sends text as it is safe to (held back where a stop string may begin), not token
        # by token; per-chunk logprobs would need the two kept in step. The whole answer has them.
        raise bad_request("logprobs are not streamed by tokenmill: ask for them without stream", param="stream")
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _EventStream(_events(state, request, prepared, include_usage))
    out = await _final_output(request, await state.backend.stream(prepared))
    if out is None:
        return StreamingResponse(iter(()), status_code=CLIENT_CLOSED)
    return state.backend.response_body(prepared, out)


class _Client:
    """Whether the HTTP client has gone away, asked at most every DISCONNECT_POLL_S.

    Asked on a clock, not when no token came: a generating request gets a token every step, so
    waiting for a quiet moment never asked at all and an abandoned request ran to the end. Nothing
    else tells a non-streaming handler: uvicorn neither cancels it nor fails its sends."""

    def __init__(self, request: Request) -> None:
        self._request = request
        self._next_check = time.monotonic() + DISCONNECT_POLL_S

    async def gone(self) -> bool:
        if time.monotonic() < self._next_check:
            return False
        self._next_check = time.monotonic() + DISCONNECT_POLL_S
        return await self._request.is_disconnected()


async def _final_output(request: Request, stream: RequestStream) -> RequestOutput | None:
    """The finished output, or None if the client went away (its request is then aborted)."""
    client = _Client(request)
    try:
        while True:
            try:
                out = await stream.next(DISCONNECT_POLL_S)
            except Exception as exc:
                raise APIError(500, f"the engine failed on this request: {exc}", type="server_error") from None
            if out is not None and out.finished:
                return out
            if await client.gone():
                return None
    finally:
        stream.abort()  # no-op once finished; frees the KV blocks of an abandoned request


async def _events(state: ServeState, request: Request, prepared: Prepared,
                  include_usage: bool) -> AsyncGenerator[str, None]:
    # Submitted here, not in the handler: a client gone before the body starts never costs a token.
    stream = await state.backend.stream(prepared)
    client = _Client(request)
    chunk = _ChunkMaker(prepared, state.model_name, include_usage)
    # A stop string is cut from the text once it is complete; hold back the characters that could
    # be its beginning so that nothing already sent has to be taken back.
    hold = max((len(s) for s in prepared.engine_request.params.stop), default=1) - 1
    sent = 0
    try:
        if chunk.chat:
            yield chunk.sse(chunk.choice({"role": "assistant", "content": ""}))
        while True:
            try:
                out = await stream.next(DISCONNECT_POLL_S)
            except Exception as exc:
                yield f"data: {json.dumps(APIError(500, str(exc), type='server_error').body())}\n\n"
                return
            # Starlette's disconnect listener usually cancels us first; this covers the servers it
            # trusts to fail a send instead (ASGI spec 2.4), which uvicorn's silent drops never do.
            if await client.gone():
                return
            if out is None:
                continue
            end = len(out.text) if out.finished else max(sent, len(out.text) - hold)
            if end > sent:
                yield chunk.sse(chunk.choice(out.text[sent:end]))
                sent = end
            if out.finished:
                yield chunk.sse(chunk.choice("", out.finish_reason))
                break
        if include_usage:
            yield chunk.sse({"choices": [], "usage": usage(out)})
        yield "data: [DONE]\n\n"
    finally:  # also on cancellation (Starlette's disconnect listener) and on _EventStream's aclose
        stream.abort()


class _EventStream(StreamingResponse):
    """Closes its event generator however the response ends. When the client goes away while the
    generator is parked at a `yield` (a send in progress), Starlette's cancellation never reaches
    the generator, and its `finally` (the abort) would wait for garbage collection."""

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # a no-op once the generator has ended


class _ChunkMaker:
    def __init__(self, prepared: Prepared, model: str, include_usage: bool) -> None:
        self.chat = prepared.request.url == CHAT_URL
        self.base = {"id": prepared.request.custom_id,
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": int(time.time()), "model": model}
        if include_usage:
            self.base["usage"] = None  # OpenAI: null on every chunk but the last

    def choice(self, delta: str | dict[str, str], finish_reason: str | None = None) -> dict[str, Any]:
        if self.chat:
            content = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            item = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason}
        else:
            item = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"choices": [item]}

    def sse(self, fields: dict[str, Any]) -> str:
        return f"data: {json.dumps({**self.base, **fields}, ensure_ascii=False)}\n\n"
