"""The FastAPI application: routes, error shape, OpenAPI document, and the engine's lifetime
(started with the app, drained and stopped with it), plus the uvicorn server that drains first."""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from lora_runtime import AsyncEngine
from server.bridge import Admission
from server.config import ServerConfig
from server.db import Database
from server.errors import install_error_handlers
from server.metrics import ServerMetrics
from server.protocol import (CompatRequest, ErrorResponse, GenerateRequest, GenerateResponse,
                             StreamResponse)
from server.routes import control, inference, service
from server.state import ServerState

logger = logging.getLogger(__name__)


def create_app(config: ServerConfig, engine, database: Database) -> FastAPI:
    """The app serving `engine` (a `lora_runtime.Engine`); its lifespan runs one `AsyncEngine`."""
    admission = Admission(config.max_in_flight, config.retry_after_s)
    state = ServerState(config=config, database=database, engine=engine, admission=admission,
                        metrics=None)
    state.metrics = ServerMetrics(lambda: state.async_engine and state.async_engine.stats(),
                                  lambda: admission.num_in_flight)
    app = FastAPI(title="LoRA serving", version="0.1.0", lifespan=_lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.include_router(inference.router)
    app.include_router(service.router)
    app.include_router(control.router)
    app.openapi = lambda: _openapi(app)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    async_engine = AsyncEngine(state.engine)
    await async_engine.start()
    state.async_engine = async_engine
    try:
        yield
    finally:
        await _drain_and_stop(state)


async def _drain_and_stop(state: ServerState) -> None:
    """Refuse new requests, let those in flight finish within the deadline, then stop the engine
    (which aborts whatever is left)."""
    deadline = time.monotonic() + state.config.shutdown_deadline_s
    state.admission.begin_draining()
    if not await state.admission.wait_idle(state.config.shutdown_deadline_s):
        logger.warning("%d requests still in flight at the shutdown deadline; aborting them",
                       state.admission.num_in_flight)
    await state.async_engine.shutdown(max(deadline - time.monotonic(), 0.0))


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the hand-read request bodies and the bearer security scheme."""
    if app.openapi_schema:
        return app.openapi_schema
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for model in (GenerateRequest, CompatRequest, GenerateResponse, StreamResponse, ErrorResponse):
        model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(model_schema.pop("$defs", {}))
        schemas[model.__name__] = model_schema
    document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in document["paths"].items():
        for operation in operations.values():
            if path != "/health":
                operation["security"] = [{"bearer": []}]
    app.openapi_schema = document
    return document


class DrainingServer(uvicorn.Server):
    """uvicorn, but on the exit signal the app first refuses new requests with 503 shutting_down;
    in-flight requests get `shutdown_deadline_s` before uvicorn cancels them."""

    def __init__(self, app: FastAPI, config: ServerConfig, **uvicorn_options: Any) -> None:
        options = {"log_level": "info", **uvicorn_options}
        super().__init__(uvicorn.Config(
            app, host=config.host, port=config.port,
            timeout_graceful_shutdown=max(1, round(config.shutdown_deadline_s)), **options))
        self._app = app

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._app.state.server.admission.begin_draining()
        super().handle_exit(sig, frame)

    def request_exit(self) -> None:
        """Begin a graceful shutdown from another thread (what a SIGTERM does)."""
        self._app.state.server.admission.begin_draining()
        self.should_exit = True
