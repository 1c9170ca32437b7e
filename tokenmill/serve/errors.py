"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status,
and the same shape declared in the OpenAPI description (`error_responses`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from tokenmill.openai_compat import RequestError

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error",
        param: str | None = None, code: str | None = None,
    ) -> None:
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
    code = "context_length_exceeded" if "context" in message and "tokens" in message else None
    return bad_request(message, param=exc.param if isinstance(exc, RequestError) else None, code=code)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('msg')}"
            return bad_request(message, code="invalid_json").response()
        # loc starts with where the value was (body, query, path, ...); the field comes after it.
        loc = [str(p) for p in first.get("loc", ())[1:]]
        param = loc[0] if loc else None  # the top-level field, as OpenAI names it; the message has the rest
        where = ".".join(loc) or "body"
        return bad_request(f"{where}: {first.get('msg', 'invalid value')}", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(request)
        return APIError(exc.status_code, str(exc.detail), type=kind).response(headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")  # a bug, not the client's fault: keep serving
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()


def _allowed_methods(request: Request) -> str:
    """The `Allow` of a 405: every method the path has. Starlette's names only the first route that
    matched the path, so `/v1/batches` (GET and POST, two routes) would have said just GET."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))
