"""The FastAPI app: routes and auth over the state they share (state.py)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, File, Form, Request, UploadFile
from fastapi.responses import FileResponse, Response
from pydantic import BaseModel

from tokenmill.serve import openai_api
from tokenmill.serve.batches import public
from tokenmill.serve.errors import APIError, bad_request, install_handlers
from tokenmill.serve.state import ServeState

OPEN_PATHS = ("/health",)  # the only route that needs no API key (load balancers probe it)


class BatchCreate(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def create_app(state: ServeState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.start()
        try:
            yield
        finally:
            state.close()

    app = FastAPI(title="tokenmill", lifespan=lifespan, dependencies=[Depends(_auth(state.api_key))])
    install_handlers(app)
    app.include_router(openai_api.router(state))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.loop.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [state.model_object()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        state.check_model(model)
        return state.model_object()

    _file_routes(app, state)
    _batch_routes(app, state)
    return app


def _file_routes(app: FastAPI, state: ServeState) -> None:
    @app.post("/v1/files")
    async def upload(file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]) -> dict[str, Any]:
        if purpose != "batch":
            raise bad_request(f"purpose must be 'batch', got {purpose!r}", param="purpose")
        data = await file.read()
        return public(state.files.create(data, file.filename or "upload.jsonl", purpose))

    @app.get("/v1/files/{file_id}")
    async def file_object(file_id: str) -> dict[str, Any]:
        return public(state.files.get(file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> FileResponse:
        return FileResponse(state.files.path(file_id), media_type="application/octet-stream")


def _batch_routes(app: FastAPI, state: ServeState) -> None:
    @app.post("/v1/batches")
    async def create(body: BatchCreate) -> dict[str, Any]:
        return state.batches.create(body.input_file_id, body.endpoint, body.completion_window, body.metadata)

    @app.get("/v1/batches/{batch_id}")
    async def get(batch_id: str) -> dict[str, Any]:
        return state.batches.get(batch_id)

    @app.get("/v1/batches")
    async def list_batches(limit: int = 20, after: str | None = None) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise bad_request(f"limit must be in [1, 100], got {limit}", param="limit")
        return state.batches.list(limit, after)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str) -> dict[str, Any]:
        return state.batches.cancel(batch_id)


def _auth(api_key: str | None) -> Any:
    async def check(request: Request) -> None:
        if api_key is None or request.url.path in OPEN_PATHS:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided: pass it as 'Authorization: Bearer <key>'",
                           type="invalid_request_error", code="invalid_api_key")

    return check
