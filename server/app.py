"""The FastAPI application: routes, error shape, OpenAPI document, and the engine's lifetime
(started with the app, drained and stopped with it), plus the uvicorn server that drains first."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from server.adapter_sources import AdapterServices, adapter_services
from server.bridge import Admission
from server.config import ServerConfig
from server.cpu_placement import CpuPlacement
from server.db import Database
from lora_runtime.api import EngineBackend
from server.errors import install_error_handlers
from server.metrics import MetricsListener, ServerMetrics
from server.openai_api import routes as openai_routes
from server.openai_api.protocol import ChatCompletionRequest, CompletionRequest, OpenAIErrorResponse
from server.protocol import (CompatRequest, ErrorResponse, GenerateRequest, GenerateResponse,
                             StreamResponse)
from server.registry.sweeper import sweep_uploads_periodically
from server.registry.uploads import UPLOAD_ROUTE
from server.routes import control, inference, registry, service
from server.routes.docs import install_offline_docs
from server.state import ServerState

logger = logging.getLogger(__name__)
# Seconds past the drain's deadline that uvicorn then waits for what is still open: the aborted
# requests' answers, and requests the drain does not count (uploads, control-plane calls).
_GRACE_MARGIN_S = 3
# How often the drain looks for a forced exit; uvicorn's own shutdown polls at this rate too.
_FORCE_EXIT_POLL_S = 0.1


def create_app(config: ServerConfig, engine: EngineBackend, database: Database,
               adapters: AdapterServices | None = None, placement: CpuPlacement | None = None) -> FastAPI:
    """The app serving `engine` (an `AsyncEngine`, or a cluster's `RemoteEngine`), which its
    lifespan starts and stops. `adapters` defaults to the registry that `config` describes (what
    `pbase` sources read); `placement`, where known, is shown in `/info`."""
    admission = Admission(config.max_in_flight, config.retry_after_s)
    state = ServerState(config=config, database=database, async_engine=engine, admission=admission,
                        metrics=None,
                        adapters=adapters or adapter_services(config, database, engine.info),
                        placement=placement)
    state.metrics = ServerMetrics(lambda: engine.stats() if engine.is_running else None,
                                  lambda: admission.num_in_flight, config.metrics_max_adapters)
    app = FastAPI(title="LoRA serving", version="0.1.0", lifespan=_lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.include_router(inference.router)
    app.include_router(openai_routes.router)
    app.include_router(service.router)
    app.include_router(control.router)
    app.include_router(registry.router)
    app.openapi = lambda: _openapi(app)
    install_offline_docs(app)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    await state.async_engine.start()
    if state.config.metrics_port is not None:
        state.metrics_listener = MetricsListener(state.metrics, state.config.host, state.config.metrics_port)
        state.metrics_listener.start()
    sweeper = asyncio.create_task(
        sweep_uploads_periodically(state.adapters.registry, state.config.upload_sweep_interval_s))
    try:
        yield
    finally:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        await _drain(state)
        await state.async_engine.shutdown(0.0)
        if state.metrics_listener is not None:
            state.metrics_listener.stop()


async def _drain(state: ServerState) -> None:
    """Refuse new requests and give those in flight until the deadline; then abort the rest in the
    engine, so that each still gets an answer (500, or an error event on a stream) before uvicorn
    closes its connection."""
    state.admission.begin_draining()
    if not await state.admission.wait_idle(state.config.shutdown_deadline_s):
        logger.warning("%d requests still in flight at the shutdown deadline; aborting them",
                       state.admission.num_in_flight)
        await state.async_engine.shutdown(0.0)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the hand-read request bodies and the bearer security scheme."""
    if app.openapi_schema:
        return app.openapi_schema
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for model in (GenerateRequest, CompatRequest, GenerateResponse, StreamResponse, ErrorResponse,
                  ChatCompletionRequest, CompletionRequest, OpenAIErrorResponse):
        model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(model_schema.pop("$defs", {}))
        schemas[model.__name__] = model_schema
    document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in document["paths"].items():
        for operation in operations.values():
            # Signed upload URLs are their own authorization (docs/api.md section 7).
            if path != "/health" and not path.startswith(UPLOAD_ROUTE):
                operation["security"] = [{"bearer": []}]
    app.openapi_schema = document
    return document


class DrainingServer(uvicorn.Server):
    """uvicorn, but the exit signal starts a drain before uvicorn's own shutdown: the listening
    sockets stay open, so new requests get 503 shutting_down and `/health` says draining (instead
    of "connection refused"), while those in flight get `shutdown_deadline_s` to finish; then the
    engine aborts the rest and uvicorn closes the sockets, waiting for those answers."""

    def __init__(self, app: FastAPI, config: ServerConfig, **uvicorn_options: Any) -> None:
        options = {"log_level": "info", **uvicorn_options}
        grace_s = math.ceil(config.shutdown_deadline_s) + _GRACE_MARGIN_S
        super().__init__(uvicorn.Config(app, host=config.host, port=config.port,
                                        timeout_graceful_shutdown=grace_s, **options))
        self._state: ServerState = app.state.server

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Refuse at once: the main loop only notices `should_exit` at its next tick.
        self._state.admission.begin_draining()
        super().handle_exit(sig, frame)

    def request_exit(self) -> None:
        """Begin a graceful shutdown from another thread (what a SIGTERM does)."""
        self._state.admission.begin_draining()
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Drain while still listening; uvicorn's own shutdown then closes the sockets."""
        await self._drain_unless_forced()
        await super().shutdown(sockets)

    async def _drain_unless_forced(self) -> None:
        """The drain, cut short by a second Ctrl+C (uvicorn's force exit), as uvicorn's own wait is."""
        drain = asyncio.ensure_future(_drain(self._state))
        while not drain.done() and not self.force_exit:
            await asyncio.wait({drain}, timeout=_FORCE_EXIT_POLL_S)
        if not drain.done():
            drain.cancel()
            logger.warning("forced exit: %d requests in flight were not drained",
                           self._state.admission.num_in_flight)
            return
        drain.result()
