"""The HTTP service's settings: one frozen dataclass, filled by `server.__main__` (the only place that
reads environment variables) or by tests."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Limits and locations of one server instance.

    `max_in_flight` bounds the requests admitted to the engine at once (past it: 429 at once);
    `max_body_bytes` bounds a request body (past it: 413 before the body is read whole).
    """

    host: str = "127.0.0.1"
    port: int = 8080
    data_dir: Path = Path(".data")
    database_url: str | None = None
    deployments_file: Path | None = None
    max_in_flight: int = 128
    max_body_bytes: int = 1 << 20
    # Caps max_new_tokens below the context length when set (operators use it to bound latency).
    max_new_tokens_limit: int | None = None
    keepalive_s: float = 15.0
    retry_after_s: int = 1
    shutdown_deadline_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")

    @property
    def resolved_database_url(self) -> str:
        """The SQLAlchemy URL: `database_url` when given, else SQLite in the data directory."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'state.db').resolve()}"
