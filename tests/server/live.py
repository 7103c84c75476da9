"""A real server on loopback for tests: uvicorn in a thread on a free port, serving the embedded
model through a fresh AsyncEngine, with tenants `demo` and `other` and a private deployment each."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from lora_runtime import AsyncEngine
from server.app import DrainingServer, create_app
from server.config import ServerConfig
from server.db import Database, open_database
from server.deployments import register_deployments
from server.state import ServerState
from server.tenancy import Deployment, create_tenant, create_token

TENANTS = ("demo", "other")


@dataclass
class LiveServer:
    server: DrainingServer
    thread: threading.Thread
    base_url: str
    database: Database
    tokens: dict[str, str]
    model_name: str

    @property
    def state(self) -> ServerState:
        return self.server.config.app.state.server

    def prefix(self, tenant: str = "demo", deployment: str | None = None) -> str:
        return f"{self.base_url}/{tenant}/deployments/v2/llms/{deployment or self.model_name}"

    def headers(self, tenant: str = "demo") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[tenant]}"}

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.request_exit()
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "server did not stop"
        self.database.dispose()


def pbase_engine(shared, data_dir: Path, database: Database, config=None):
    """An engine on `shared`'s weights (and `config`, else its config) whose `pbase` source reads
    the registry in `database`, as the server's own engine does."""
    from lora_runtime import Engine
    from server.adapter_sources import engine_adapter_sources

    sources = engine_adapter_sources(ServerConfig(data_dir=data_dir), database)
    return Engine(config or shared.config, shared.model, shared.tokenizer, shared.model_name, sources)


def start_live_server(engine, data_dir: Path, **overrides) -> LiveServer:
    database = open_database(f"sqlite:///{data_dir / 'state.db'}")
    tokens = {}
    for tenant in TENANTS:
        create_tenant(database, tenant)
        tokens[tenant] = create_token(database, tenant)
    private = [Deployment(f"{tenant}-private", tenant, engine.model_name) for tenant in TENANTS]
    register_deployments(database, [engine.model_name], private)
    config = replace(ServerConfig(port=0, data_dir=data_dir), **overrides)
    server = DrainingServer(create_app(config, AsyncEngine(engine), database), config, log_level="warning")
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return LiveServer(server, thread, f"http://127.0.0.1:{port}", database, tokens, engine.model_name)
