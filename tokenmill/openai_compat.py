"""OpenAI request and response bodies ↔ the engine, in one place.

A body (a `tokenmill run` line, a live `/v1/completions` or `/v1/chat/completions` request, a
Batch API line) is read and checked once, by `parse_request`, into an `OpenAIRequest` (its prompt
or messages and its `SamplingParams`), which every later step takes; an engine `RequestOutput`
becomes the response body with its `usage`. Batch jobs, the server and its Batch API all go
through here, so one body gets the same answer, and the same refusal naming the same field, on
every path.

Each body field read is written once, as a `BodyField` (its JSON schema and its check), which the
server's request bodies and OpenAPI document are built from (`body_fields`). To support a new one:
a sampling field is an entry in `SAMPLING_FIELDS` (checked on every line of every job by
`check_fields`) and its line in `sampling_params`; a new way to ask for a structured output, an
entry in `STRUCTURED_FIELDS` with its reader (the value → StructuredOutputsParams' arguments;
checked by `structured_outputs` wherever tokenmill's engine serves the body). Or refuse it in
`UNSUPPORTED_FIELDS`.

Log-probabilities are asked for in each endpoint's own words (chat: `logprobs: true` with
`top_logprobs: N`; completions: `logprobs: N`), become `SamplingParams.logprobs`, and come back in
that endpoint's own shape (`response_body`), each token shown as its text decoded alone.

A structured output (a JSON schema, JSON mode, a choice, a regex, a grammar) comes from one of
`STRUCTURED_FIELDS`: OpenAI's `response_format` or one of vLLM's extensions, so that files
written for vLLM run unchanged. Its shape is checked here; whether it compiles is the
engine's to say, and `check_structured_outputs` names the field it came from.
"""

from __future__ import annotations

import base64
import functools
import itertools
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from tokenmill.embed.config import MAX_TRUNCATE
from tokenmill.embed.inputs import EmbeddingInputError, EmbeddingInputs
from tokenmill.engine import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutputsParams,
)

if TYPE_CHECKING:  # names only: their modules load torch, which a body's checks do not need
    from tokenmill.engine import InProcessModel, Prompt, RequestOutput, TokenLogprob

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
GENERATION_URLS = (CHAT_URL, COMPLETIONS_URL)
SUPPORTED_URLS = (*GENERATION_URLS, EMBEDDINGS_URL)

# Body fields that change what the caller gets back; refusing beats silently ignoring them.
# (The server takes `stream` off a live request before it gets here; a batch line cannot stream.)
UNSUPPORTED_FIELDS = (
    "tools", "tool_choice", "functions", "function_call",
    "logit_bias", "echo", "suffix", "best_of", "stream", "presence_penalty", "frequency_penalty",
)


class RequestError(ValueError):
    """A body the engine cannot serve as asked. The message names the field as `body.<field>`;
    `param` is that field (OpenAI's error `param`), or None when no one field is at fault."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(printable(message))
        self.param, self.code = param, code  # code: OpenAI's error code, where it has one


def printable(text: str) -> str:
    """`text` with any lone surrogate written as its escape (`\\udfff`): it has no UTF-8 form, so
    an error message or row quoting one could not be sent or written at all."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


ID_HEX_DIGITS = 24  # after an id's prefix: 12 random bytes in lowercase hex
FILE_ID_PREFIX, BATCH_ID_PREFIX = "file-", "batch_"


def new_id(prefix: str) -> str:
    """An OpenAI-style id: `chatcmpl-…`, `batch_req_…`, `file-…`."""
    return f"{prefix}{os.urandom(ID_HEX_DIGITS // 2).hex()}"  # uuid4 costs 5× more, and a row needs two


def is_own_id(value: str, prefix: str) -> bool:
    """Whether `value` is exactly an id `new_id(prefix)` makes. Ids a server takes back (files,
    batches) are checked with this and nothing looser: an id with a path part, a suffix or another
    case must not reach an object under another spelling (one spelling stored, another compared)."""
    digits = value[len(prefix):]
    return (value.startswith(prefix) and len(digits) == ID_HEX_DIGITS
            and all(c in "0123456789abcdef" for c in digits))


def id_format(prefix: str) -> str:
    """How `is_own_id` ids look, for messages."""
    return f"{prefix!r} and {ID_HEX_DIGITS} lowercase hex digits"


def new_response_id(url: str) -> str:
    return new_id("chatcmpl-" if url == CHAT_URL else "cmpl-")


# ---- requests ------------------------------------------------------------------------------------
# The ranges of the fields we read, as OpenAI documents them (vLLM's for its extras). The server's
# request models quote these too, so its schema and this check agree.
MAX_TEMPERATURE = 2.0
MAX_STOP_SEQUENCES = 16  # OpenAI allows 4; vLLM sets no limit, and files written for it carry more
SEED_RANGE = (-(2**63), 2**64 - 1)  # what a 64-bit generator takes
CHAT_ROLES = ("system", "developer", "user", "assistant")  # "tool" would need tools
MAX_TOP_LOGPROBS = MAX_LOGPROBS  # chat's top_logprobs: 0..20
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs: 0..5


@dataclass(frozen=True)
class OpenAIRequest:
    """What a body asks for, checked (`parse_request`): the prompt (/v1/completions) or the
    messages (/v1/chat/completions), and how to sample. Later steps take this, never the body."""

    url: str  # CHAT_URL or COMPLETIONS_URL
    prompt: str | list[int] | None  # a completion's text or token ids; None for a chat
    messages: list[dict[str, str]] | None  # a chat's messages as plain text (chat_messages); None otherwise
    template_kwargs: dict[str, Any] | None  # a chat's chat_template_kwargs
    params: SamplingParams  # with its structured_outputs, if the body asks for one
    structured_outputs_field: str | None  # the body field that structured output came from (for messages)


@dataclass(frozen=True)
class LiveRequest:
    """A request sent to the server and answered on its connection (a batch line is a job's
    BatchRequest, which also knows its line)."""

    custom_id: str  # the response's id: what keys it in the engine, as a batch line's custom_id does
    url: str  # CHAT_URL or COMPLETIONS_URL
    body: dict[str, Any]

    @functools.cached_property
    def parsed(self) -> OpenAIRequest:
        """The body read and every field checked, once (RequestError)."""
        return parse_request(self.url, self.body)


def parse_request(url: str, body: dict[str, Any], *, fields_checked: bool = False) -> OpenAIRequest:
    """Everything about a body that can be checked without the engine, checked once (a prompt too
    long for the context is the engine's to refuse). `fields_checked`: `check_fields` has already
    passed on this body (jobs/input/reader.py runs it on every line), so it is not run again. Raises
    RequestError."""
    check_text(body)
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) not in (None, False, 0, [], {}):
            raise RequestError(f"body.{name} is not supported by tokenmill", name)
    params = sampling_params(body, url=url, fields_checked=fields_checked)  # every field, and how they combine
    n = body.get("n", 1)
    if n != 1:
        raise RequestError(f"body.n = {n}: tokenmill returns one choice per request", "n")
    structured = structured_outputs_fields(body)[0] if params.structured_outputs is not None else None
    if url == CHAT_URL:
        return OpenAIRequest(url, None, chat_messages(body["messages"]), template_kwargs(body), params, structured)
    return OpenAIRequest(url, body["prompt"], None, None, params, structured)


# A lone half of a UTF-16 surrogate pair: what a JSON "\udfff" escape without its other half reads
# as (the parsers join a whole pair into one character, so any left is broken text). It has no UTF-8
# form: a tokenizer, a grammar compiler or a response quoting it fails on it.
_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = frozenset({int, float, bool, type(None)})  # values that hold no text
_NAME = re.compile(r"[A-Za-z_]\w*", re.ASCII)  # a key a path names as `.key`; others as `["key"]`


def check_text(body: dict[str, Any]) -> None:
    """Refuse a body with a lone surrogate in any string, key or value, at any depth, naming where
    (`body.messages[0].content`), before anything tries to encode it. Raises RequestError."""
    found = _lone_surrogate(body)
    if found is None:
        return
    path, char, at = found
    top = path[0] if path and isinstance(path[0], str) and _surrogate_at(path[0]) is None else None
    raise RequestError(_not_text(json_path(path), char, at), top)


def check_string(text: str, where: str) -> None:
    """`check_text` for one string outside a body (a batch line's custom_id), named `where`."""
    if (at := _surrogate_at(text)) is not None:
        raise RequestError(_not_text(where, text[at], at))


def _not_text(where: str, char: str, at: int) -> str:
    return (f"{where} holds a lone surrogate ({ascii(char)[1:-1]} at character {at}), which is not text: "
            "a \\ud800-\\udfff escape must be one half of a pair")


def json_path(path: tuple[str | int, ...], root: str = "body") -> str:
    """Where a value is in a body, as messages name it: `body.messages[0].content`."""
    def step(part: str | int) -> str:
        if isinstance(part, int):
            return f"[{part}]"
        return f".{part}" if _NAME.fullmatch(part) else f"[{json.dumps(part)}]"  # json.dumps: escaped, printable

    return root + "".join(map(step, path))


def _lone_surrogate(body: dict[str, Any]) -> tuple[tuple[str | int, ...], str, int] | None:
    """The first string (in document order) holding a lone surrogate: its path (a key's path ends
    at the key), the surrogate, its index. A loop, not recursion: a body may nest ~900 levels deep."""
    todo: list[tuple[tuple[str | int, ...], Any]] = [((), body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            if (at := _surrogate_at(value)) is not None:
                return path, value[at], at
        elif isinstance(value, dict):
            for key in value:
                if isinstance(key, str) and (at := _surrogate_at(key)) is not None:
                    return (*path, key), key[at], at
            todo.extend(((*path, key), item) for key, item in reversed(value.items())
                        if isinstance(item, (str, list, dict)))
        elif isinstance(value, list) and not _SCALARS.issuperset(map(type, value)):  # token ids: one C loop
            todo.extend(((*path, i), value[i]) for i in range(len(value) - 1, -1, -1)
                        if isinstance(value[i], (str, list, dict)))
    return None


def _surrogate_at(text: str) -> int | None:
    if text.isascii():  # a flag lookup: only text that could hold a surrogate is searched
        return None
    match = _SURROGATE.search(text)
    return None if match is None else match.start()


def template_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's chat_template_kwargs: variables for the chat template (e.g. enable_thinking)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise RequestError(f"body.chat_template_kwargs must be an object, got {_show(kwargs)}", "chat_template_kwargs")
    return kwargs


@dataclass(frozen=True)
class BodyField:
    """A field of a body, written once: its JSON schema (what the server's OpenAPI document shows)
    and its check (what every batch line and live request is held to, with the same message), on
    the endpoints that take it. The check takes the body and raises RequestError naming the field;
    a structured-output field's also returns the setting it read."""

    name: str
    schema: dict[str, Any]
    check: Callable[[dict[str, Any]], object]
    urls: tuple[str, ...] = GENERATION_URLS


def _integer_field(name: str, low: int, high: int | None = None, description: str = "",
                   urls: tuple[str, ...] = GENERATION_URLS) -> BodyField:
    # A bound is a JSON number, which a reader may take as a double: 2**64 - 1 reads as 2**64.
    bounds = {"minimum": low} | ({} if high is None else {"maximum": high})
    return BodyField(name, {"type": "integer", **bounds, "description": description},
                     functools.partial(_integer, name=name, low=low, high=high), urls)


def _number_field(name: str, low: float, high: float, description: str, low_open: bool = False) -> BodyField:
    low_bound = {"exclusiveMinimum": low} if low_open else {"minimum": low}
    return BodyField(name, {"type": "number", **low_bound, "maximum": high, "description": description},
                     functools.partial(_number, name=name, low=low, high=high, low_open=low_open))


def _boolean_field(name: str, description: str, urls: tuple[str, ...] = GENERATION_URLS, hint: str = "") -> BodyField:
    return BodyField(name, {"type": "boolean", "description": description},
                     functools.partial(_boolean, name=name, hint=hint), urls)


def requested_logprobs(body: dict[str, Any], url: str) -> int | None:
    """SamplingParams.logprobs for a checked body: how many alternatives per token, or None."""
    if url == CHAT_URL:
        return (body.get("top_logprobs") or 0) if body.get("logprobs") is True else None
    return body.get("logprobs")


def _integer(body: dict[str, Any], *, name: str, low: int, high: int | None = None) -> None:
    value = body.get(name)
    if value is None:
        return
    if not _is_int(value):
        raise RequestError(f"body.{name} must be an integer, got {_show(value)}", name)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"body.{name} must be {bound}, got {value}", name)


def _number(body: dict[str, Any], *, name: str, low: float, high: float, low_open: bool = False) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"body.{name} must be a finite number, got {_show(value)}", name)
    if not (low < value if low_open else low <= value) or value > high:
        raise RequestError(f"body.{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value}", name)


def _boolean(body: dict[str, Any], *, name: str, hint: str) -> None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"body.{name} must be true or false, got {_show(value)}{hint}", name)


def _check_token_ids(ids: Any) -> None:
    if ids is not None and not (isinstance(ids, list) and all(_is_int(t) and t >= 0 for t in ids)):
        raise RequestError(f"body.stop_token_ids must be a list of token ids (integers >= 0), got {_show(ids)}",
                           "stop_token_ids")


def _check_stop(stop: Any) -> None:
    if stop is None or (isinstance(stop, str) and stop):
        return
    if not isinstance(stop, list):
        raise RequestError(f"body.stop must be a non-empty string or a list of them, got {_show(stop)}", "stop")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise RequestError(f"body.stop: at most {MAX_STOP_SEQUENCES} items, got {len(stop)}", "stop",
                           code="array_above_max_length")
    for i, item in enumerate(stop):
        if not (isinstance(item, str) and item):
            raise RequestError(f"body.stop[{i}] must be a non-empty string, got {_show(item)}", "stop")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: Any, limit: int = 60) -> str:
    """A value as JSON, cut short: an error message must not echo a megabyte back."""
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


# The sampling fields read (`sampling_params`), in OpenAI's words and ranges (vLLM's for its extras).
# A new one is an entry here and its line in `sampling_params`; the server's schema follows.
SAMPLING_FIELDS = (
    _integer_field("max_tokens", 1, description="the most tokens to generate"),
    _integer_field("max_completion_tokens", 1, description="OpenAI's newer name for max_tokens; wins over it"),
    _integer_field("n", 1, description="choices per request (one is served)"),
    _integer_field("min_tokens", 0, description="vLLM: tokens generated before a stop may end the answer"),
    _integer_field("top_k", -1, description="vLLM: sample from the k likeliest tokens; -1 or 0: all"),
    _integer_field("seed", *SEED_RANGE, description="the same seed and body give the same answer"),
    _number_field("temperature", 0.0, MAX_TEMPERATURE, "0: greedy"),
    _number_field("top_p", 0.0, 1.0, "nucleus sampling", low_open=True),
    _boolean_field("ignore_eos", "vLLM: go on past the end-of-sequence token"),
    BodyField("stop", {"anyOf": [{"type": "string", "minLength": 1},
                                 {"type": "array", "items": {"type": "string", "minLength": 1},
                                  "maxItems": MAX_STOP_SEQUENCES}],
                       "description": "text that ends the answer (not included in it)"},
              lambda body: _check_stop(body.get("stop"))),
    BodyField("stop_token_ids", {"type": "array", "items": {"type": "integer", "minimum": 0},
                                 "description": "vLLM: token ids that end the answer"},
              lambda body: _check_token_ids(body.get("stop_token_ids"))),
    _boolean_field("logprobs", "return each token's log-probability", urls=(CHAT_URL,),
                   hint=" (the number of alternatives is body.top_logprobs)"),
    _integer_field("top_logprobs", 0, MAX_TOP_LOGPROBS, "with logprobs: true, the N likeliest alternatives",
                   urls=(CHAT_URL,)),
    _integer_field("logprobs", 0, MAX_COMPLETION_LOGPROBS, "the N likeliest alternatives of each token",
                   urls=(COMPLETIONS_URL,)),
)


def sampling_fields(url: str) -> tuple[BodyField, ...]:
    return tuple(f for f in SAMPLING_FIELDS if url in f.urls)


def check_fields(body: dict[str, Any], url: str = CHAT_URL) -> None:
    """The type and range of every sampling field present: a string "5", `true` or Infinity is
    refused naming the field, never coerced. `url`: the endpoint, whose words `logprobs` is read
    in. Raises RequestError."""
    for field in sampling_fields(url):
        field.check(body)
    if url == CHAT_URL and body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        raise RequestError("body.top_logprobs needs body.logprobs: true", "top_logprobs")
    if url != CHAT_URL and body.get("top_logprobs") is not None:
        raise RequestError("body.top_logprobs is a chat field: a /v1/completions body asks for N alternatives "
                           "with body.logprobs: N", "top_logprobs")


def requested_max_tokens(body: dict[str, Any]) -> int:
    """max_completion_tokens (OpenAI's newer name), else max_tokens, else the engine's default."""
    return body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS


def sampling_params(body: dict[str, Any], *, url: str = CHAT_URL, fields_checked: bool = False) -> SamplingParams:
    """OpenAI (and vLLM's extra) body fields → SamplingParams; RequestError names the body field.
    `url`: the endpoint the body is for; `fields_checked`: `check_fields` has already passed on it."""
    if not fields_checked:
        check_fields(body, url)
    stop = body.get("stop") or []
    top_k = body.get("top_k", 0)
    structured = structured_outputs(body)
    try:
        return SamplingParams(
            max_tokens=requested_max_tokens(body),
            min_tokens=body.get("min_tokens", 0),
            temperature=float(body.get("temperature", DEFAULT_TEMPERATURE)),
            top_p=float(body.get("top_p", 1.0)),
            top_k=0 if top_k == -1 else top_k,
            seed=body.get("seed"),
            ignore_eos=body.get("ignore_eos", False),
            stop_token_ids=list(body.get("stop_token_ids") or []),
            stop=[stop] if isinstance(stop, str) else list(stop),
            structured_outputs=structured,
            logprobs=requested_logprobs(body, url),
        )
    except (TypeError, ValueError) as exc:
        message = str(exc).replace("SamplingParams.", "body.")
        field = re.search(r"body\.(\w+)", message)
        raise RequestError(message, field.group(1) if field else None) from None


# ---- structured outputs -------------------------------------------------------------------------
# OpenAI's `response_format` and vLLM's fields (`structured_outputs`, and the older `guided_*`) each
# ask for one of these kinds; a body uses at most one field.
STRUCTURED_OUTPUTS_KINDS = tuple(f.name for f in fields(StructuredOutputsParams))  # json, json_object, choice, ...
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# response_format.json_schema's fields beside `schema`, by JSON type: ignored here, yet of their type.
JSON_SCHEMA_OPTIONS = {"name": "string", "description": "string", "strict": "boolean"}
_JSON_TYPES: dict[str, tuple[type, str]] = {"string": (str, "a string"), "boolean": (bool, "true or false")}


def structured_outputs_fields(body: dict[str, Any]) -> list[str]:
    """The fields of `body` that ask for a structured output."""
    return [name for name in STRUCTURED_OUTPUTS_FIELDS if _asks_for_one(name, body.get(name))]


def _asks_for_one(name: str, value: Any) -> bool:
    # Null is absent; `response_format: {"type": "text"}` asks for none: it is OpenAI's default, said out loud.
    return value is not None and not (name == "response_format" and isinstance(value, dict)
                                      and value.get("type") == "text")


def structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The body's structured-output setting (None when it asks for none); RequestError names the
    field, e.g. `body.response_format.json_schema.schema`, for a wrong shape or two fields set."""
    names = structured_outputs_fields(body)
    if len(names) > 1:
        raise RequestError(f"body.{names[0]} and body.{names[1]} both ask for a structured output: give one",
                           names[0])
    if not names:
        return None
    setting = _STRUCTURED_BY_NAME[names[0]].check(body)  # the field's entry in STRUCTURED_FIELDS: its one check
    assert isinstance(setting, StructuredOutputsParams)  # the field asks for one (`names`)
    return setting


def _structured_setting(body: dict[str, Any], *, name: str,
                        read: Callable[[Any], dict[str, Any]]) -> StructuredOutputsParams | None:
    """A STRUCTURED_FIELDS entry's check: the setting the body's field `name` asks for, read by
    `read` (its value → StructuredOutputsParams' arguments) and held to StructuredOutputsParams'
    rules. None when it asks for none."""
    value = body.get(name)
    if not _asks_for_one(name, value):
        return None
    try:
        return StructuredOutputsParams(**read(value))
    except ValueError as exc:
        raise _named(str(exc), name) from None


def check_structured_outputs(request: OpenAIRequest, llm: InProcessModel) -> None:
    """Compile the request's structured output for this model (the engine compiles each distinct
    one once); RequestError naming the field when it does not compile: an invalid schema, a keyword
    the compiler does not support, a regex or grammar with an error, a compile over the time limit.
    Only an engine whose capabilities say it can does this here; vLLM refuses it when it is submitted."""
    setting = request.params.structured_outputs
    check = None if setting is None else llm.engine.capabilities.check_structured_outputs
    if setting is None or check is None:
        return
    try:
        check(setting)
    except ValueError as exc:
        raise _named(str(exc), request.structured_outputs_field or "structured_outputs") from None


def structured_outputs_body(setting: StructuredOutputsParams) -> dict[str, Any]:
    """The body field that asks for `setting`: OpenAI's `response_format` for a JSON schema or JSON
    mode (any OpenAI-compatible server knows it), vLLM's `structured_outputs` for the rest."""
    if setting.json is not None:
        # `name` is required by OpenAI; `strict` asks OpenAI to enforce the schema, as we always do.
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "output", "schema": setting.json, "strict": True}}}
    if setting.json_object:
        return {"response_format": {"type": "json_object"}}
    return {"structured_outputs": {setting.kind: getattr(setting, setting.kind)}}


def _response_format(value: Any) -> dict[str, Any]:
    """OpenAI's `response_format` (other than "text") → StructuredOutputsParams' arguments."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise RequestError(f'body.response_format must be an object with a "type" of '
                           f"{', '.join(RESPONSE_FORMAT_TYPES)}, got {_show(value)}", "response_format")
    # `name` is required by OpenAI but changes nothing here: a body without it is served. `strict`
    # is accepted and ignored: the schema is always enforced. Still, each has its type, as live.
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError(f'body.response_format.json_schema must be an object with a "schema", got {_show(spec)}',
                           "response_format")
    for name, json_type in JSON_SCHEMA_OPTIONS.items():
        python_type, said = _JSON_TYPES[json_type]
        if spec.get(name) is not None and not isinstance(spec[name], python_type):
            raise RequestError(f"body.response_format.json_schema.{name} must be {said}, got {_show(spec[name])}",
                               "response_format")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise RequestError(f"body.response_format.json_schema.schema must be a JSON schema (an object), "
                           f"got {_show(schema)}", "response_format")
    return {"json": schema}


def _vllm_structured_outputs(value: Any) -> dict[str, Any]:
    """vLLM's `structured_outputs` → StructuredOutputsParams' arguments. Its other options
    (structural tags, whitespace patterns, ...) would change the output: refused, not ignored."""
    if not isinstance(value, dict):
        raise RequestError(f"body.structured_outputs must be an object with one of "
                           f"{', '.join(STRUCTURED_OUTPUTS_KINDS)}, got {_show(value)}", "structured_outputs")
    unknown = next((key for key in value if key not in STRUCTURED_OUTPUTS_KINDS), None)
    if unknown is not None:
        raise RequestError(f"body.structured_outputs.{unknown} is not supported by tokenmill (it takes "
                           f"one of {', '.join(STRUCTURED_OUTPUTS_KINDS)})", "structured_outputs")
    return {key: setting for key, setting in value.items() if setting is not None}


def _named(message: str, name: str) -> RequestError:
    """A message about `structured_outputs[.<kind>]` (StructuredOutputsParams', the engine's) as
    one about the body field the setting came from."""
    match = re.match(r"structured_outputs(?:\.(\w+))?", message)
    kind = match.group(1) if match else None
    if name == "structured_outputs":
        where = f"body.structured_outputs.{kind}" if kind else "body.structured_outputs"
    elif name == "response_format" and kind == "json":
        where = "body.response_format.json_schema.schema"
    else:
        where = f"body.{name}"
    return RequestError(where + message[match.end():] if match else f"{where}: {message}", name)


def _structured_field(name: str, schema: dict[str, Any], description: str,
                      read: Callable[[Any], dict[str, Any]]) -> BodyField:
    return BodyField(name, {**schema, "description": description},
                     functools.partial(_structured_setting, name=name, read=read))


def _guided(kind: str) -> Callable[[Any], dict[str, Any]]:
    """How `guided_<kind>` reads: its value is `structured_outputs.<kind>`'s."""
    return lambda value: {kind: value}


_TEXT_SCHEMA = {"type": "string", "minLength": 1}
# Each kind's value (StructuredOutputsParams' rules), as `structured_outputs.<kind>` and `guided_<kind>` take it.
_KIND_SCHEMAS: dict[str, dict[str, Any]] = {
    "json": {"anyOf": [{"type": "object"}, {"type": "string"}], "description": "a JSON schema, or its text"},
    "json_object": {"type": "boolean", "description": "true: any JSON object"},
    "choice": {"type": "array", "items": _TEXT_SCHEMA, "minItems": 1, "description": "exactly one of these strings"},
    "regex": {**_TEXT_SCHEMA, "description": "a full match of this regular expression (Rust regex syntax)"},
    "grammar": {**_TEXT_SCHEMA, "description": "a sentence of this Lark or GBNF grammar"},
}

_RESPONSE_FORMAT_SCHEMA = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "enum": list(RESPONSE_FORMAT_TYPES)},
        "json_schema": {
            "type": "object",
            "properties": {"schema": {"type": "object", "description": "the JSON schema the answer follows"},
                           **{name: {"type": json_type} for name, json_type in JSON_SCHEMA_OPTIONS.items()}},
            "required": ["schema"],
            "description": 'with "type": "json_schema". `name` (required by OpenAI) may be left out; `strict` is '
                           "accepted and ignored: the schema is always enforced",
        },
    },
    "required": ["type"],
}

# The body fields that ask for a structured output: OpenAI's, then vLLM's. Their checks are the
# engine's rules, run by `structured_outputs` wherever a body reaches tokenmill's engine (a live
# request, a Batch API line, an embedded job's line), not by `check_fields`: a job's --endpoint
# server gets them as written and may take options tokenmill does not.
STRUCTURED_FIELDS = (
    _structured_field("response_format", _RESPONSE_FORMAT_SCHEMA,
                      'OpenAI\'s: "json_schema", "json_object" (any JSON object), or "text" (as if not given)',
                      _response_format),
    _structured_field("structured_outputs", {"type": "object", "properties": _KIND_SCHEMAS, "minProperties": 1,
                                             "maxProperties": 1, "additionalProperties": False},
                      "vLLM's: one of these (its other options would change the answer: refused)",
                      _vllm_structured_outputs),
    *(_structured_field(f"guided_{kind}", schema, f"vLLM's older name for structured_outputs.{kind}: "
                                                  f"{schema['description']}", _guided(kind))
      for kind, schema in _KIND_SCHEMAS.items() if kind != "json_object"),
)
STRUCTURED_OUTPUTS_FIELDS = tuple(f.name for f in STRUCTURED_FIELDS)
_STRUCTURED_BY_NAME = {f.name: f for f in STRUCTURED_FIELDS}


def body_fields(url: str) -> tuple[BodyField, ...]:
    """Every field the endpoint reads beyond its prompt or messages (an embedding's `input`
    included): what the server's request body declares."""
    return tuple(f for f in SAMPLING_FIELDS + STRUCTURED_FIELDS + EMBEDDING_FIELDS if url in f.urls)


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages with string content (text parts joined); other roles and parts are refused.
    OpenAI's "developer" role is the chat templates' "system"."""
    plain = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise RequestError(f"body.messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {_show(role)}",
                               "messages")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"body.messages[{i}]: only text content parts are supported by tokenmill",
                                   "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"body.messages[{i}].content must be a string or a list of text parts, "
                               f"got {_show(content)}", "messages")
        plain.append({"role": "system" if role == "developer" else role, "content": content})
    return plain


def check_prompt_size(request: OpenAIRequest, llm: InProcessModel) -> None:
    """Refuse a text prompt too long for the context by its length, without tokenizing it (which
    takes seconds per megabyte), as the engine's input processor does. Token-id prompts are counted as
    they are, as cheaply, by the engine."""
    if request.messages is not None:
        llm.engine.check_prompt_chars(sum(len(m["content"]) for m in request.messages))
    elif isinstance(request.prompt, str):
        llm.engine.check_prompt_chars(len(request.prompt))


def engine_inputs(request: OpenAIRequest, llm: InProcessModel) -> tuple[Prompt, SamplingParams]:
    """The prompt (a chat through the model's own chat template) and the sampling settings."""
    check_structured_outputs(request, llm)
    if request.messages is None:
        assert request.prompt is not None
        return request.prompt, request.params
    try:
        ids = llm.chat_token_ids(request.messages, request.template_kwargs)
    except (TemplateError, TypeError) as exc:
        raise RequestError(f"cannot build the prompt: {exc}", "messages") from None
    return {"prompt_token_ids": ids}, request.params


# ---- responses -----------------------------------------------------------------------------------
def usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


TokenText = Callable[[int], str]  # a token id → the text logprobs show for it


def token_decoder(tokenizer: Any) -> TokenText:
    """Each token's own text, for logprobs: the token decoded alone, as vLLM shows it (a piece of
    a character that takes several tokens comes out as U+FFFD), remembered per id. Without a
    tokenizer, "token_id:N" (vLLM's spelling for a token it does not decode)."""
    if tokenizer is None:
        return lambda token_id: f"token_id:{token_id}"
    return functools.cache(lambda token_id: tokenizer.decode([token_id]))


def response_body(url: str, out: RequestOutput, model: str, response_id: str | None = None, *,
                  token_text: TokenText | None = None) -> dict[str, Any]:
    """A finished output as the chat.completion or text_completion object OpenAI would return.
    `token_text`: how logprobs show a token (`token_decoder` of the model's tokenizer)."""
    text_of = token_text or token_decoder(None)
    if url == CHAT_URL:
        logprobs = None if out.logprobs is None else chat_logprobs(out.logprobs, text_of)
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "logprobs": logprobs, "finish_reason": out.finish_reason}
        kind = "chat.completion"
    else:
        logprobs = None if out.logprobs is None else completion_logprobs(out.logprobs, text_of)
        choice = {"index": 0, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason}
        kind = "text_completion"
    return {"id": response_id or new_response_id(url), "object": kind, "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(out)}


def chat_logprobs(logprobs: list[TokenLogprob], text_of: TokenText) -> dict[str, Any]:
    """`choices[0].logprobs` of a chat.completion: per token its text, logprob and UTF-8 bytes,
    and its top_logprobs in the same shape, most likely first."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}


def completion_logprobs(logprobs: list[TokenLogprob], text_of: TokenText) -> dict[str, Any]:
    """`choices[0].logprobs` of a text_completion (OpenAI's legacy shape): parallel lists of the
    tokens, their logprobs, {token: logprob} of the alternatives (the chosen token always among
    them, so up to N + 1), and where each token starts in the text of the tokens before it."""
    tokens = [text_of(lp.token_id) for lp in logprobs]
    tops = []
    for lp, token in zip(logprobs, tokens, strict=True):
        top = {text_of(t): v for t, v in lp.top}
        top.setdefault(token, lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs], "top_logprobs": tops,
            "text_offset": list(itertools.accumulate(map(len, tokens), initial=0))[:-1]}


def is_response_body(url: str, body: Any) -> bool:
    """Whether `body` has the shape of `url`'s answer: choices for a completion, a list of data for
    embeddings. What a server returned with a 200 is checked by this before it is kept."""
    if not isinstance(body, dict):
        return False
    if url == EMBEDDINGS_URL:
        return body.get("object") == "list" and isinstance(body.get("data"), list)
    return isinstance(body.get("choices"), list)


def response_kind(url: str) -> str:
    """How messages name `url`'s answer."""
    return "an embeddings body" if url == EMBEDDINGS_URL else "a completion body"


def api_root(url: str) -> str:
    """`http://host:8000/v1` → `http://host:8000`: the API's paths (CHAT_URL, /v1/batches) start with /v1."""
    return url.rstrip("/").removesuffix("/v1")


# ---- embeddings ----------------------------------------------------------------------------------
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one request
ENCODING_FORMATS = ("float", "base64")  # base64: the vector's little-endian float32 bytes


@dataclass(frozen=True)
class EmbeddingRequest:
    """What a /v1/embeddings body asks for, checked (`parse_embedding_request`): its inputs as
    texts or as token-id lists (one of the two), and how the vectors come back."""

    texts: list[str] | None
    token_ids: list[list[int]] | None
    listed: bool  # `input` was a list of inputs (errors then name `body.input[i]`)
    encoding_format: str
    dimensions: int | None
    truncate_prompt_tokens: int | None  # embed/config.MAX_TRUNCATE: to the model's limit

    def where(self, index: int) -> str:
        """How messages name input `index`."""
        return f"body.input[{index}]" if self.listed else "body.input"


def _check_encoding_format(body: dict[str, Any]) -> None:
    value = body.get("encoding_format")
    if value is not None and value not in ENCODING_FORMATS:
        raise RequestError(f"body.encoding_format must be one of {', '.join(ENCODING_FORMATS)}, got {_show(value)}",
                           "encoding_format")


def _check_truncation(body: dict[str, Any]) -> None:
    value = body.get("truncate_prompt_tokens")
    if value is not None and not (_is_int(value) and (value == MAX_TRUNCATE or value >= 1)):
        raise RequestError(f"body.truncate_prompt_tokens must be {MAX_TRUNCATE} (the model's limit) or a positive "
                           f"integer, got {_show(value)}", "truncate_prompt_tokens")


_EMBEDDING_INPUT_SCHEMA = {
    "anyOf": [{"type": "string", "minLength": 1},
              {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
               "maxItems": MAX_EMBEDDING_INPUTS},
              {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
              {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
               "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS}],
    "description": "a text, a list of texts, a list of token ids or a list of such lists",
}
EMBEDDING_FIELDS = (
    BodyField("input", _EMBEDDING_INPUT_SCHEMA, lambda body: _embedding_inputs(body), (EMBEDDINGS_URL,)),
    BodyField("encoding_format", {"type": "string", "enum": list(ENCODING_FORMATS),
                                  "description": "float (default), or base64 of the little-endian float32 values"},
              _check_encoding_format, (EMBEDDINGS_URL,)),
    _integer_field("dimensions", 1, description="the vector's size: the model's own, or less for a Matryoshka model",
                   urls=(EMBEDDINGS_URL,)),
    BodyField("truncate_prompt_tokens", {"type": "integer", "minimum": MAX_TRUNCATE,
                                         "description": "vLLM: cut each input to this many tokens; -1: to the "
                                                        "model's limit (without it, a longer input is refused)"},
              _check_truncation, (EMBEDDINGS_URL,)),
)


def parse_embedding_request(body: dict[str, Any]) -> EmbeddingRequest:
    """A /v1/embeddings body, every field checked; RequestError names the field (`body.input[3]`)."""
    check_text(body)
    texts, token_ids, listed = _embedding_inputs(body)
    for field in EMBEDDING_FIELDS:
        if field.name != "input":  # read above, for its value
            field.check(body)
    return EmbeddingRequest(texts, token_ids, listed, body.get("encoding_format") or "float",
                            body.get("dimensions"), body.get("truncate_prompt_tokens"))


def _embedding_inputs(body: dict[str, Any]) -> tuple[list[str] | None, list[list[int]] | None, bool]:
    """(texts, token-id lists, whether `input` was a list of inputs)."""
    value = body.get("input")
    if value is None:
        raise RequestError('missing field "body.input"', "input")
    if isinstance(value, str):
        if not value:
            raise RequestError("body.input is an empty string: an embedding needs text", "input")
        return [value], None, False
    if not isinstance(value, list) or not value:
        raise RequestError(f"body.input must be a string, a list of strings, a list of token ids or a list of "
                           f"such lists, got {_show(value)}", "input")
    if all(_is_int(t) for t in value):
        return None, [_token_ids(value, "body.input")], False
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise RequestError(f"body.input: at most {MAX_EMBEDDING_INPUTS} inputs in one request, got {len(value)}",
                           "input", code="array_above_max_length")
    if all(isinstance(item, str) for item in value):
        empty = next((i for i, item in enumerate(value) if not item), None)
        if empty is not None:
            raise RequestError(f"body.input[{empty}] is an empty string: an embedding needs text", "input")
        return list(value), None, True
    if all(isinstance(item, list) for item in value):
        return None, [_token_ids(item, f"body.input[{i}]") for i, item in enumerate(value)], True
    raise RequestError("body.input mixes kinds: give strings only, or token-id lists only", "input")


def _token_ids(value: list[Any], where: str) -> list[int]:
    if not value:
        raise RequestError(f"{where} is an empty list: an embedding needs at least one token", "input")
    bad = next((i for i, t in enumerate(value) if not (_is_int(t) and t >= 0)), None)  # an index: the value may be null
    if bad is not None:
        raise RequestError(f"{where} must be token ids (integers >= 0), got {_show(value[bad])}", "input")
    return value


def embedding_inputs(request: EmbeddingRequest, embedder: EmbeddingInputs) -> list[list[int]]:
    """The request's inputs as the token ids the embedder runs (texts tokenized, ids checked,
    truncated where asked); RequestError names the input or field at fault."""

    try:
        embedder.check_dimensions(request.dimensions)
    except ValueError as exc:
        raise RequestError(f"body.dimensions = {request.dimensions}: {exc}", "dimensions") from None
    try:
        if request.texts is not None:
            return embedder.tokenize(request.texts, request.truncate_prompt_tokens)
        assert request.token_ids is not None
        return embedder.token_ids(request.token_ids, request.truncate_prompt_tokens)
    except EmbeddingInputError as exc:
        raise RequestError(f"{request.where(exc.index)}: {exc.reason}", "input") from None
    except ValueError as exc:  # the truncation asked for is over the model's limit
        raise RequestError(f"body.{exc}", "truncate_prompt_tokens") from None


def embedding_response_body(request: EmbeddingRequest, vectors: Sequence[Any], model: str,
                            prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings response: a list of {"object": "embedding", "index", "embedding"} in
    the inputs' order, each vector as floats or as base64 of its float32 bytes."""
    def encoded(vector: Any) -> list[float] | str:
        if request.encoding_format == "base64":
            return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        return vector.tolist()

    data = [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
