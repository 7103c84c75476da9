"""What the routes share: configuration, database, the engine bridge, admission, metrics and the
adapter registry services."""
from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection

from lora_runtime.api import EngineBackend, EngineInfo
from server.adapter_sources import AdapterServices
from server.bridge import Admission
from server.config import ServerConfig
from server.cpu_placement import CpuPlacement
from server.db import Database
from server.metrics import MetricsListener, ServerMetrics


@dataclass(slots=True)
class ServerState:
    config: ServerConfig
    database: Database
    async_engine: EngineBackend  # started and stopped with the app
    admission: Admission
    metrics: ServerMetrics | None
    adapters: AdapterServices
    metrics_listener: MetricsListener | None = None  # while the app runs, with `metrics_port`
    placement: CpuPlacement | None = None  # the engine's and the service's CPUs, where this process knows them

    @property
    def engine_info(self) -> EngineInfo:
        return self.async_engine.info

    @property
    def model_name(self) -> str:
        return self.engine_info.model_name


def server_state(connection: HTTPConnection) -> ServerState:
    return connection.app.state.server
