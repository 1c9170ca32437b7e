"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status,
and the same shape declared in the OpenAPI description (`error_responses`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from tokenmill.openai_compat import RequestError, check_text, printable

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error",
        param: str | None = None, code: str | None = None,
    ) -> None:
        message = printable(message)  # a message quoting a lone surrogate could not be sent: a 500
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """The body of every error response (APIError.body), as the OpenAPI description shows it."""

    error: ErrorDetail


# What each status means on this server, for the OpenAPI description.
ERROR_MEANINGS = {
    400: "invalid request: a field of the wrong type or out of range, an unsupported field, a prompt "
         "too long for the context, a body that is not JSON, an upload that is not JSONL",
    401: "missing or wrong API key (only when the server runs with --api-key)",
    404: "unknown model, file or batch",
    409: "the object is in a state that does not allow this",
    413: "request body over --max-request-bytes, or upload over --max-upload-bytes",
    415: "a JSON route's body sent with a Content-Type other than application/json",
    500: "a server error: this request failed, the others go on",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route or app: these statuses, each with the OpenAI error body."""
    return {status: {"model": ErrorBody, "description": ERROR_MEANINGS[status]} for status in statuses}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(exc: ValueError) -> APIError:
    """A refused body (openai_compat.RequestError names its field) or prompt (the engine's)."""
    message = str(exc)
    if isinstance(exc, RequestError):
        return bad_request(message, param=exc.param, code=exc.code)
    code = "context_length_exceeded" if "context" in message and "tokens" in message else None
    return bad_request(message, code=code)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if isinstance(exc.body, dict):  # broken text, wherever it is, in its own words rather than pydantic's
            try:
                check_text(exc.body)
            except RequestError as broken:
                return from_value_error(broken).response()
        errors = list(exc.errors())
        first = _most_telling(errors) if errors else {}
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('msg')}"
            return bad_request(message, code="invalid_json").response()
        if tuple(first.get("loc", ())) == ("body",) and not _is_json(request.headers.get("content-type")):
            return _not_json(request.headers.get("content-type")).response()
        return _field_error(first).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, RecursionError):  # FastAPI's "There was an error parsing the body"
            return bad_request(f"the request body nests arrays or objects deeper than this server parses "
                               f"(about {MAX_JSON_DEPTH} levels)", code="invalid_json").response()
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(request)
        return APIError(exc.status_code, str(exc.detail), type=kind).response(headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")  # a bug, not the client's fault: keep serving
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()


# Python's JSON parser stops at its recursion limit (a RecursionError, which FastAPI reports as "There
# was an error parsing the body"); the depth it reaches is the limit less the frames already in use.
MAX_JSON_DEPTH = 900
# A value that fits no member of a union is reported once per member (`stop`: a string or a list);
# the members' names then sit in `loc` after the field, where the user wrote none.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|list|dict|none)(\[.*\])?$|^[a-z-]+\[.*\]$")


def _most_telling(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The error to report, of the first field refused: where its value fits no member of a union,
    pydantic lists 'not a string' before 'a list of at most 16', and the member the value has the
    type of says what is wrong with it."""
    first = errors[0]
    field = tuple(first.get("loc", ()))[:2]
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:2] == field]
    # Not a wrong type first (17 strings are a list, too long), then the deepest (`stop: [1]` is a
    # list whose item 0 is not a string); min keeps pydantic's order among equals.
    return min(same_field, key=lambda e: (str(e.get("type", "")).endswith("_type"), -len(e.get("loc", ()))))


def _field_error(error: dict[str, Any]) -> APIError:
    """A refused field, `where: what is wrong`: a list's length in its own words and with OpenAI's
    code for it (array_above_max_length, empty_array), else pydantic's message."""
    # loc starts with where the value was (body, query, path, ...); the field comes after it.
    loc = [str(p) for p in error.get("loc", ())[1:] if not _UNION_MEMBER.match(str(p))]
    param = loc[0] if loc else None  # the top-level field, as OpenAI names it; the message has the rest
    where = ".".join(loc) or "body"
    ctx, kind = error.get("ctx") or {}, error.get("type")
    if kind == "too_long" and "max_length" in ctx:
        return bad_request(f"{where}: at most {ctx['max_length']} items, got {ctx.get('actual_length')}",
                           param=param, code="array_above_max_length")
    if kind == "too_short" and ctx.get("actual_length") == 0:
        return bad_request(f"{where}: an empty list; at least {ctx.get('min_length')} item(s)", param=param,
                           code="empty_array")
    return bad_request(f"{where}: {error.get('msg', 'invalid value')}", param=param)


def _is_json(content_type: str | None) -> bool:
    """application/json or a +json type: what FastAPI reads as JSON (strictly: not a body without one)."""
    if not content_type:
        return False
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _not_json(content_type: str | None) -> APIError:
    """A body sent as text/plain or a form is not read as JSON, as OpenAI's API does not read it;
    the 415 says so instead of 'Input should be a valid dictionary'."""
    said = f"says {content_type!r}" if content_type else "has none"
    return APIError(415, f"the request body must be JSON, sent with 'Content-Type: application/json' (this "
                    f"request {said}; with curl, add -H 'Content-Type: application/json')",
                    code="unsupported_media_type")


def _allowed_methods(request: Request) -> str:
    """The `Allow` of a 405: every method the path has. Starlette's names only the first route that
    matched the path, so `/v1/batches` (GET and POST, two routes) would have said just GET."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))
