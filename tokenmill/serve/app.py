"""The FastAPI app: routes, auth, body limits and the OpenAPI description, over the state they
share (state.py)."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from tokenmill.openai_compat import SUPPORTED_URLS
from tokenmill.serve import openai_api
from tokenmill.serve.batches import (
    COMPLETION_WINDOWS,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE_CHARS,
    OUTPUT_EXPIRY_SECONDS,
    public,
)
from tokenmill.serve.errors import APIError, bad_request, error_responses, install_handlers
from tokenmill.serve.limits import ApiKeyCheck, BodyLimit
from tokenmill.serve.state import ServeState

OPEN_PATHS = ("/health",)  # the only route that needs no API key (load balancers probe it)
OPENAPI_PATH = "/openapi.json"


class OutputExpiresAfter(BaseModel):
    """When a batch's output and error files are deleted: `seconds` after each file is created."""

    # The allowed values, for the description; BatchManager.create refuses the others by name.
    anchor: str = Field(strict=True, json_schema_extra={"enum": ["created_at"]})
    seconds: int = Field(strict=True, json_schema_extra={"minimum": OUTPUT_EXPIRY_SECONDS[0],
                                                         "maximum": OUTPUT_EXPIRY_SECONDS[1]})


class BatchCreate(BaseModel):
    input_file_id: str
    # The allowed values, for the description; BatchManager.create refuses the others by name.
    endpoint: str = Field(json_schema_extra={"enum": list(SUPPORTED_URLS)})
    completion_window: str = Field("24h", json_schema_extra={"enum": list(COMPLETION_WINDOWS)})
    # The limits, for the description; BatchManager.create refuses the rest by name.
    metadata: dict[str, str] | None = Field(None, json_schema_extra={
        "maxProperties": MAX_METADATA_KEYS, "propertyNames": {"maxLength": MAX_METADATA_KEY_CHARS},
        "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS}})
    output_expires_after: OutputExpiresAfter | None = None


def create_app(state: ServeState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.start()
        # Everything alive now (model, tokenizer, imports) lives as long as the server: out of the
        # collector's sight, a full collection no longer walks it and stalls every client (as vLLM does).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            state.close()

    # FastAPI's own docs routes are replaced by ours below (`--no-docs` turns them off, and they know
    # a proxy's path prefix).
    app = FastAPI(title="tokenmill", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None,
                  responses=error_responses(500, *([401] if state.api_key else [])))
    install_handlers(app)
    app.add_middleware(BodyLimit, max_request_bytes=state.max_request_bytes, max_upload_bytes=state.max_upload_bytes)
    if state.api_key is not None:  # added last, so it runs first: no key, no word about the body's size either
        app.add_middleware(ApiKeyCheck, api_key=state.api_key, open_paths=OPEN_PATHS)
    app.include_router(openai_api.router(state), responses=error_responses(400, 404, 413, 415))

    @app.get("/health", response_class=Response, responses={503: {"description": "the model has stopped answering"}})
    async def health() -> Response:
        return Response(status_code=200 if state.alive else 503)

    # response_class=Response: a text/plain one would have FastAPI declare the JSON errors as text too.
    text = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}

    @app.get("/metrics", response_class=Response, responses=text)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [state.model_object()]}

    @app.get("/v1/models/{model:path}", responses=error_responses(404))
    async def model(model: str) -> dict[str, Any]:
        state.check_model(model)
        return state.model_object()

    _file_routes(app, state)
    _batch_routes(app, state)
    app.openapi = _openapi(app, state)  # type: ignore[method-assign]
    if state.docs:
        _doc_routes(app)
    return app


def _file_routes(app: FastAPI, state: ServeState) -> None:
    @app.post("/v1/files", responses=error_responses(400, 413))
    async def upload(file: Annotated[UploadFile, File(description="JSONL: one Batch API request per line")],
                     purpose: Annotated[str, Form(json_schema_extra={"enum": ["batch"]})]) -> dict[str, Any]:
        if purpose != "batch":
            raise bad_request(f"purpose must be 'batch', got {purpose!r}", param="purpose")
        # Starlette has spooled the upload to a temporary file; copying and checking it takes a
        # while for a large one, so off the event loop.
        obj = await run_in_threadpool(state.files.upload, file.file, file.filename or "upload.jsonl", purpose,
                                      max_bytes=state.max_upload_bytes, max_line_bytes=state.max_request_bytes)
        return public(obj)

    @app.get("/v1/files")
    async def list_files(purpose: str | None = None) -> dict[str, Any]:
        # OpenAI pages this list; one page holds every file here.
        return {"object": "list", "data": [public(f) for f in state.files.list(purpose)], "has_more": False}

    @app.get("/v1/files/{file_id}", responses=error_responses(404))
    async def file_object(file_id: str) -> dict[str, Any]:
        return public(state.files.get(file_id))

    @app.delete("/v1/files/{file_id}", responses=error_responses(404, 409))
    async def delete_file(file_id: str) -> dict[str, Any]:
        # OpenAI lets a running batch's input go; here the batch would fail when it next reads it
        # (on a restart, it is read again to resume), so it stays until the batch is over.
        state.files.get(file_id)  # an unknown id is a 404, not a 409
        if batch_id := state.batches.reading(file_id):
            raise APIError(409, f"file {file_id} is the input of batch {batch_id}, which is still running: "
                                "cancel the batch or wait for it to end", param="file_id", code="file_in_use")
        return state.files.delete(file_id)

    binary = {200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}

    @app.get("/v1/files/{file_id}/content", response_class=Response, responses={**binary, **error_responses(404)})
    async def file_content(file_id: str) -> FileResponse:
        return FileResponse(state.files.path(file_id), media_type="application/octet-stream")


def _batch_routes(app: FastAPI, state: ServeState) -> None:
    @app.post("/v1/batches", responses=error_responses(400, 404, 413, 415))
    async def create(body: BatchCreate) -> dict[str, Any]:
        expiry = body.output_expires_after.model_dump() if body.output_expires_after else None
        return state.batches.create(body.input_file_id, body.endpoint, body.completion_window, body.metadata, expiry)

    @app.get("/v1/batches/{batch_id}", responses=error_responses(404))
    async def get(batch_id: str) -> dict[str, Any]:
        return state.batches.get(batch_id)

    @app.get("/v1/batches", responses=error_responses(400))
    async def list_batches(limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None) -> dict[str, Any]:
        return state.batches.list(limit, after)

    @app.post("/v1/batches/{batch_id}/cancel", responses=error_responses(404, 409))
    async def cancel(batch_id: str) -> dict[str, Any]:
        return state.batches.cancel(batch_id)


def _doc_routes(app: FastAPI) -> None:
    """/openapi.json, /docs and /redoc as ordinary routes: `--no-docs` leaves them out, and /docs and
    /redoc find the description behind a proxy's path prefix. The API key covers them as any route."""

    @app.get(OPENAPI_PATH, include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def swagger(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=_schema_url(request), title=f"{app.title} - Swagger UI")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(openapi_url=_schema_url(request), title=f"{app.title} - ReDoc")


def _schema_url(request: Request) -> str:
    return request.scope.get("root_path", "").rstrip("/") + OPENAPI_PATH  # behind a proxy's path prefix too


def _openapi(app: FastAPI, state: ServeState) -> Callable[[], dict[str, Any]]:
    """`app.openapi`: FastAPI's description, corrected where the server does otherwise."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _as_served(generate(), auth=state.api_key is not None)
        return app.openapi_schema

    return openapi


def _as_served(schema: dict[str, Any], auth: bool) -> dict[str, Any]:
    for operations in schema["paths"].values():
        for operation in operations.values():
            # FastAPI declares a 422 on every route with parameters; errors.py answers those with a 400.
            operation["responses"].pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    if auth:
        schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
        for path in OPEN_PATHS:
            for operation in schema["paths"][path].values():
                operation["responses"].pop("401")  # declared app-wide: taken back where no key is asked
                operation["security"] = []
    return schema

