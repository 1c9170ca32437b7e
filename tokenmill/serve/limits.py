"""What a request must pass before its body is read, as pure ASGI middleware: the API key (401),
then how large the body may be (413, before the app reads past the limit); and the limits'
defaults (cli.py and ServeState share them).

Import-light on purpose: cli.py reads the defaults when `tokenmill --help` builds its parser, and
that must not load FastAPI (tokenmill/serve/__init__.py), so errors.py is imported where a 413 is made.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from tokenmill.serve.errors import APIError

# JSON routes. The largest legitimate body is one prompt: even a 128k-token context sent as token
# ids (~7 bytes each) or as text with every character \u-escaped is a few MB, so 10 MiB never
# refuses a real request and stops a client from making the server parse (and hold) hundreds of MB.
DEFAULT_MAX_REQUEST_BYTES = 10 * 2**20
# `POST /v1/files`: OpenAI takes Batch API input files "up to 200 MB"
# (https://platform.openai.com/docs/guides/batch); read as MiB, so nothing OpenAI takes is refused.
DEFAULT_MAX_UPLOAD_BYTES = 200 * 2**20
# The multipart envelope around an upload's bytes (boundaries, part headers, the `purpose` field):
# the body may exceed the file limit by this much; the upload route checks the file itself exactly.
UPLOAD_ENVELOPE_BYTES = 64 * 2**10
UPLOAD_PATH = "/v1/files"


def too_large(what: str, limit: int, flag: str) -> APIError:
    """The 413 for a body or file over `limit` bytes; `flag` is the server option that sets it."""
    from tokenmill.serve.errors import APIError  # here, not at the top: see the module docstring

    return APIError(413, f"{what} is larger than {limit} bytes, this server's limit ({flag})",
                    code="request_too_large")


class ApiKeyCheck:
    """Refuses a request without `Authorization: Bearer <api_key>` with a 401 from its headers alone,
    before a byte of its body is read: a FastAPI dependency runs only once FastAPI has read the body,
    which for an upload means spooling all of it to disk. `open_paths` need no key."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...]) -> None:
        self.app, self._key, self._open_paths = app, api_key.encode(), open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open_paths or self._has_key(scope):
            await self.app(scope, receive, send)
            return
        from tokenmill.serve.errors import APIError  # here, not at the top: see the module docstring

        error = APIError(401, "Incorrect API key provided: pass it as 'Authorization: Bearer <key>'",
                         type="invalid_request_error", code="invalid_api_key")
        await _reject(error, scope, receive, send)

    def _has_key(self, scope: Scope) -> bool:
        header = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self._key)


class BodyLimit:
    """Refuses request bodies over the limit with a 413, never holding more than the limit.

    With a Content-Length the answer comes before anything is read. A chunked body is counted as
    it arrives; when it passes the limit the 413 is sent at once and the app is told the client has
    gone (`http.disconnect`), so it stops reading, and whatever it answers after that is dropped.
    """

    def __init__(self, app: ASGIApp, max_request_bytes: int, max_upload_bytes: int) -> None:
        self.app = app
        self._json = (max_request_bytes, too_large("the request body", max_request_bytes, "--max-request-bytes"))
        self._upload = (max_upload_bytes + UPLOAD_ENVELOPE_BYTES,
                        too_large("the upload", max_upload_bytes, "--max-upload-bytes"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, error = self._limit(scope)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _reject(error, scope, receive, send)
            return
        exchange = _LimitedExchange(limit, error, scope, receive, send)
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except Exception:
            if not exchange.rejected:
                raise
            # An app that reads the body itself fails on the cut (Starlette's ClientDisconnect):
            # expected, and the client has its 413.

    def _limit(self, scope: Scope) -> tuple[int, APIError]:
        """The most bytes this request's body may have, and the 413 past that."""
        if scope["method"] == "POST" and scope["path"].rstrip("/") == UPLOAD_PATH:
            return self._upload
        return self._json


class _LimitedExchange:
    """One request's `receive` and `send`, counting the body's bytes as the app reads them."""

    def __init__(self, limit: int, error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
        self._limit, self._error, self._scope, self._receive, self._send = limit, error, scope, receive, send
        self._received = 0
        self._response_started = False
        self.rejected = False  # the client has had our 413

    async def receive(self) -> Message:
        if self.rejected:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if self._received > self._limit:
                if not self._response_started:  # an app that answered before reading keeps its answer
                    self.rejected = True
                    await _reject(self._error, self._scope, self._receive, self._send)
                return {"type": "http.disconnect"}  # the rest of the body is never read
        return message

    async def send(self, message: Message) -> None:
        if self.rejected:
            return  # the app's answer to a body it never got
        if message["type"] == "http.response.start":
            self._response_started = True
        await self._send(message)


async def _reject(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    # No `Connection: close`: closing with the body unread can reset the connection before the
    # client reads the 401 or 413; the server drops the rest of the body as it arrives, never holding it.
    await error.response()(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses it; counting still applies
    return None
