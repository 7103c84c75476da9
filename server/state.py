"""What the routes share: configuration, database, the engine bridge, admission and metrics."""
from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection

from server.bridge import Admission
from server.config import ServerConfig
from server.db import Database
from server.metrics import ServerMetrics


@dataclass(slots=True)
class ServerState:
    config: ServerConfig
    database: Database
    engine: object  # lora_runtime.Engine: model_name, tokenizer, max_model_len
    admission: Admission
    metrics: ServerMetrics
    async_engine: object | None = None  # lora_runtime.AsyncEngine once the app has started

    @property
    def model_name(self) -> str:
        return self.engine.model_name


def server_state(connection: HTTPConnection) -> ServerState:
    return connection.app.state.server
