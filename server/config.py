"""The HTTP service's settings: one frozen dataclass, filled by `server.__main__` (the service's only
reader of environment variables) or by tests."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# --tool-call-format's values: "auto" and lora_runtime.sampling.tools.TOOL_CALL_FORMATS' names (spelt
# out here: the CLI does not import the engine's modules, which import torch).
TOOL_CALL_FORMAT_CHOICES = ("auto", "hermes", "mistral", "llama3_json")
# The adapters registered for tenant `demo` on a first start: `demo_adapters/<name>/` of this repo.
DEFAULT_DEMO_ADAPTERS_DIR = Path(__file__).resolve().parents[1] / "demo_adapters"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Limits and locations of one server instance.

    `max_in_flight` bounds the requests admitted to the engine at once (past it: 429 at once);
    `max_body_bytes` bounds a request body (past it: 413 before the body is read whole).

    Adapter sources (docs/api.md section 3) come only from here, never from a request: `hub_endpoint`
    (None: hub adapters answer 424 adapter_unavailable), `s3_endpoint` (None: AWS itself; the
    credentials come from the standard AWS chain), `adapter_dir` (None: no `local` source).
    The registry keeps blobs under `data_dir/blobs`, or in `registry_bucket` when set (on the same
    S3 endpoint). Signed upload URLs start with `public_url`, else with the URL the client used.

    `/metrics` (docs/api.md section 1): with `metrics_tenant` set, only that tenant's tokens read it
    (403 for the others) and see every series; unset, every tenant reads it and sees, of the series
    that name adapters, those of its own adapters. `metrics_max_adapters` bounds each tenant's
    per-adapter counters' series (its later adapters are counted in its `(other)` series).
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
    # How models write tool calls (lora_runtime.sampling.tools): "auto" picks it per request from the
    # chat template that renders it (the adapter's own, else the base model's), else a format's name.
    tool_call_format: str = "auto"
    keepalive_s: float = 15.0
    retry_after_s: int = 1
    shutdown_deadline_s: float = 30.0
    hub_endpoint: str | None = None
    s3_endpoint: str | None = None
    s3_region: str | None = None
    adapter_dir: Path | None = None
    registry_bucket: str | None = None
    public_url: str | None = None
    max_upload_bytes: int = 2 * 1024**3  # the files of one upload together
    upload_url_ttl_s: int = 3600
    max_upload_files: int = 256  # files one upload may name
    max_upload_checkpoints: int = 32  # checkpoint folders of one version (server.registry.layout's default)
    max_open_uploads: int = 8  # per tenant: started, neither finished nor expired (past it: 429)
    max_staged_upload_bytes: int = 4 * 1024**3  # per tenant: the files of its unfinished uploads (413)
    upload_sweep_interval_s: float = 600.0  # how often expired uploads' staged files are deleted
    demo_adapters_dir: Path | None = DEFAULT_DEMO_ADAPTERS_DIR
    metrics_tenant: str | None = None
    metrics_max_adapters: int = 100
    # A second listener serving every /metrics series without a token (the EPP's scraper sends none).
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if self.tool_call_format not in TOOL_CALL_FORMAT_CHOICES:
            raise ValueError(f"tool_call_format must be one of {', '.join(TOOL_CALL_FORMAT_CHOICES)}")
        if self.metrics_max_adapters < 0:
            raise ValueError("metrics_max_adapters must be >= 0")
        upload_bounds = (self.max_upload_bytes, self.max_upload_files, self.max_open_uploads,
                         self.max_staged_upload_bytes, self.upload_sweep_interval_s)
        if min(upload_bounds) <= 0 or self.max_upload_checkpoints < 0:
            raise ValueError("upload bounds and the sweep interval must be > 0 (checkpoints >= 0)")

    @property
    def resolved_database_url(self) -> str:
        """The SQLAlchemy URL: `database_url` when given, else SQLite in the data directory."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'state.db').resolve()}"
