"""What starting the service does, in one process (`python -m server`) or as a Ray Serve cluster
(`python -m server.cluster`): its command-line options turned into configurations, and a first
start's preparation of the database (tenant `demo` and its token, deployments, demo adapters).

The only module of the service that reads environment variables (docs/architecture.md lists the
others of the project): `DATABASE_URL` (any SQLAlchemy URL; default SQLite in the data directory),
when `--database-url` is not given. S3 credentials come from the standard AWS configuration chain
(boto3 reads its own environment variables and files).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from server.config import TOOL_CALL_FORMAT_CHOICES, ServerConfig
from server.db import Database
from server.tenancy import create_tenant, create_token, list_tenants

if TYPE_CHECKING:  # the engine's modules import torch: `python -m server tokens ...` does without
    from lora_runtime.config import EngineConfig
    from lora_runtime.api import EngineInfo
    from server.adapter_sources import AdapterServices

logger = logging.getLogger("server")
DEMO_TENANT = "demo"
DEMO_TOKEN_FILE = "demo-token"
_DEFAULTS = ServerConfig()


def program_name(module: str) -> str:
    """How the running command was typed, for its usage line: the installed console script's name
    (`lora-serve`, `lora-serve-cluster`) when started through it, else `python -m <module>`."""
    script = Path(sys.argv[0]).name
    return script if script.startswith("lora-serve") else f"python -m {module}"


def add_service_options(parser: argparse.ArgumentParser) -> None:
    """The options of a serving process: listening, data, the engine, limits, metrics, adapters."""
    _add_process_options(parser)
    _add_engine_options(parser)
    _add_limit_options(parser)
    _add_adapter_options(parser)
    _add_upload_options(parser)


def _add_process_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--data-dir", type=Path, default=Path(".data"))
    parser.add_argument("--database-url", default=None,
                        help="SQLAlchemy URL of the service's database (default: $DATABASE_URL, else "
                             "SQLite in the data directory)")
    parser.add_argument("--deployments", type=Path, default=None,
                        help="TOML file of private deployments (default: DIR/deployments.toml if present)")


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory or .gguf file (default: the embedded model)")
    parser.add_argument("--dtype", default=None, help="model dtype, e.g. float32 or bfloat16")
    parser.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda")
    parser.add_argument("--quantization", default=None, choices=["q8_0"],
                        help="quantize a Hugging Face checkpoint's projections while loading it (default: none)")
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="the engine's compute threads (default: OMP_NUM_THREADS where set, else one per "
                             "physical core this process may run on)")
    parser.add_argument("--kv-cache-mib", type=_positive_int, default=None,
                        help="memory of the KV cache (default on CPU: what the memory available leaves once "
                             "the weights, the adapter pools and the overhead are counted; the budget is "
                             "logged at start and shown in /info)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="compute every prompt in full instead of reusing the K/V of a cached prefix")
    parser.add_argument("--share-base-prefix-cache", action="store_true",
                        help="share the base model's cached prompt blocks across tenants (default: each "
                             "tenant's own); only for tenants that trust each other: any tenant can then "
                             "tell, from cached_tokens or timing, whether another sent a given prefix")
    parser.add_argument("--tool-call-format", choices=TOOL_CALL_FORMAT_CHOICES, default=_DEFAULTS.tool_call_format,
                        help="how the model writes tool calls on the OpenAI chat route: hermes "
                             "(<tool_call>{...}</tool_call>), mistral ([TOOL_CALLS][...]) or llama3_json "
                             "({\"name\": ..., \"parameters\": ...}); auto: per request, from the chat "
                             "template that renders it (the adapter's own, else the base model's), "
                             "hermes when it shows none")


def _add_limit_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-in-flight", type=int, default=_DEFAULTS.max_in_flight)
    parser.add_argument("--max-body-bytes", type=int, default=_DEFAULTS.max_body_bytes)
    parser.add_argument("--shutdown-deadline", type=float, default=_DEFAULTS.shutdown_deadline_s)
    parser.add_argument("--metrics-tenant", default=None,
                        help="only this tenant's tokens read /metrics, seeing every series (default: every "
                             "tenant reads it, seeing only its own adapters' series)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="also serve /metrics, every series and no token, on this port of --host, for "
                             "scrapers that send no token (routers); keep it off public networks")
    parser.add_argument("--metrics-max-adapters", type=int, default=_DEFAULTS.metrics_max_adapters,
                        help="adapters of each tenant counted in their own /metrics series; the "
                             "tenant's later ones share its (other) series")


def _add_adapter_options(parser: argparse.ArgumentParser) -> None:
    adapters = parser.add_argument_group("adapters")
    adapters.add_argument("--hub-endpoint", default=None,
                          help="Hugging Face hub URL for hub adapters, e.g. https://huggingface.co "
                               "(default: none; hub adapters answer 424)")
    adapters.add_argument("--s3-endpoint", default=None,
                          help="S3-compatible endpoint URL for s3 adapters (default: AWS)")
    adapters.add_argument("--s3-region", default=None)
    adapters.add_argument("--adapter-dir", type=Path, default=None,
                          help="enables adapter_source 'local', ids relative to this directory")
    adapters.add_argument("--registry-bucket", default=None,
                          help="keep registry blobs in this S3 bucket (default: DIR/blobs)")
    adapters.add_argument("--public-url", default=None,
                          help="base URL of signed upload URLs (default: the URL the client used)")
    adapters.add_argument("--adapter-pool-mib", type=int, default=None,
                          help="memory of the device pages adapters are served from, which bounds the adapters "
                               "resident at once (default: AdapterConfig's, 1024)")
    adapters.add_argument("--adapter-host-cache-mib", type=int, default=None,
                          help="memory of the host cache of loaded adapters (default: AdapterConfig's, 1024)")
    adapters.add_argument("--demo-adapters", type=Path, default=_DEFAULTS.demo_adapters_dir,
                          help="adapters registered for tenant demo on a first start")


def _add_upload_options(parser: argparse.ArgumentParser) -> None:
    uploads = parser.add_argument_group("uploads")
    uploads.add_argument("--max-upload-bytes", type=int, default=_DEFAULTS.max_upload_bytes,
                          help="bytes of the files of one upload together (default: 2 GiB)")
    uploads.add_argument("--max-upload-files", type=int, default=_DEFAULTS.max_upload_files,
                          help="files one upload may name, checkpoint files included")
    uploads.add_argument("--max-upload-checkpoints", type=int, default=_DEFAULTS.max_upload_checkpoints,
                          help="checkpoint-N folders of one uploaded version")
    uploads.add_argument("--max-open-uploads", type=int, default=_DEFAULTS.max_open_uploads,
                          help="uploads each tenant may have started and not finished (past it: 429)")
    uploads.add_argument("--max-staged-upload-bytes", type=int, default=_DEFAULTS.max_staged_upload_bytes,
                          help="bytes each tenant's unfinished uploads may stage (past it: 413; default: 4 GiB)")
    uploads.add_argument("--upload-sweep-interval", type=float, default=_DEFAULTS.upload_sweep_interval_s,
                          help="seconds between sweeps deleting expired uploads' staged files (also at start)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def server_config(args: argparse.Namespace) -> ServerConfig:
    deployments = args.deployments
    if deployments is None and (args.data_dir / "deployments.toml").exists():
        deployments = args.data_dir / "deployments.toml"
    return ServerConfig(host=args.host, port=args.port, data_dir=args.data_dir,
                        database_url=args.database_url or os.environ.get("DATABASE_URL") or None,
                        deployments_file=deployments, max_in_flight=args.max_in_flight,
                        max_body_bytes=args.max_body_bytes,
                        shutdown_deadline_s=args.shutdown_deadline,
                        hub_endpoint=args.hub_endpoint, s3_endpoint=args.s3_endpoint,
                        s3_region=args.s3_region, adapter_dir=args.adapter_dir,
                        registry_bucket=args.registry_bucket, public_url=args.public_url,
                        max_upload_bytes=args.max_upload_bytes, max_upload_files=args.max_upload_files,
                        max_upload_checkpoints=args.max_upload_checkpoints,
                        max_open_uploads=args.max_open_uploads,
                        max_staged_upload_bytes=args.max_staged_upload_bytes,
                        upload_sweep_interval_s=args.upload_sweep_interval,
                        demo_adapters_dir=args.demo_adapters, metrics_tenant=args.metrics_tenant,
                        metrics_max_adapters=args.metrics_max_adapters, metrics_port=args.metrics_port,
                        tool_call_format=args.tool_call_format)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from lora_runtime.config import AdapterConfig, EngineConfig, KVCacheConfig

    options = (("model", args.model), ("dtype", args.dtype), ("device", args.device), ("num_threads", args.threads),
               ("quantization", args.quantization))
    engine_options = {key: value for key, value in options if value is not None}
    # Requests never name server paths: `local` is the configured adapter directory or nothing.
    memory = (("device_pool_bytes", args.adapter_pool_mib), ("host_cache_bytes", args.adapter_host_cache_mib))
    adapter_memory = {key: mib * 2**20 for key, mib in memory if mib is not None}
    adapter_config = AdapterConfig(**adapter_memory, allow_local_paths=False)
    kv_cache = KVCacheConfig(enable_prefix_caching=not args.no_prefix_caching,
                             share_base_prefix_cache=args.share_base_prefix_cache,
                             memory_bytes=args.kv_cache_mib * 2**20 if args.kv_cache_mib else None)
    return EngineConfig(**engine_options, adapters=adapter_config, kv_cache=kv_cache)


def ensure_demo_tenant(database: Database, data_dir: Path) -> str | None:
    """On an empty database: tenant `demo` and a token, written to DIR/demo-token (mode 0600)."""
    if list_tenants(database):
        return None
    create_tenant(database, DEMO_TENANT)
    token = create_token(database, DEMO_TENANT)
    token_file = data_dir / DEMO_TOKEN_FILE
    token_file.touch(mode=0o600)
    token_file.write_text(token + "\n")
    return token


def prepare_service(config: ServerConfig, database: Database, engine: EngineInfo) -> AdapterServices:
    """The database ready to serve `engine`'s model: on a first start tenant `demo`, its token and the
    demo adapters (announced on the terminal); every start, the deployments. Returns the registry."""
    from server.adapter_sources import adapter_services
    from server.demo import register_demo_adapters
    from server.deployments import read_deployments_file, register_deployments

    demo_token = ensure_demo_tenant(database, config.data_dir)
    if config.metrics_tenant is not None and config.metrics_tenant not in list_tenants(database):
        logger.warning("--metrics-tenant %s is no tenant yet: /metrics answers 403 to every token until "
                       "it is created (python -m server tokens create --tenant %s)",
                       config.metrics_tenant, config.metrics_tenant)
    private = read_deployments_file(config.deployments_file) if config.deployments_file else []
    register_deployments(database, [engine.model_name], private)
    adapters = adapter_services(config, database, engine)
    if demo_token is not None:
        names = register_demo_adapters(adapters.registry, config.demo_adapters_dir, DEMO_TENANT)
        _announce_demo(config, engine.model_name, demo_token, names)
    return adapters


def _announce_demo(config: ServerConfig, model_name: str, token: str, adapter_names: list[str]) -> None:
    # Shown once, on the terminal of whoever started the server: the token is not logged.
    token_file = config.data_dir / DEMO_TOKEN_FILE
    prefix = f"http://{config.host}:{config.port}/{DEMO_TENANT}/deployments/v2/llms/{model_name}"

    def curl(path: str, body: str) -> str:
        return (f"  curl -s {prefix}{path} -H \"Authorization: Bearer $(cat {token_file})\" "
                f"-H 'Content-Type: application/json' -d '{body}'\n")

    lines = [f"Created tenant '{DEMO_TENANT}'. Its token (also in {token_file}):\n  {token}\n",
             "Try:\n", curl("/generate", '{"inputs": "A LoRA adapter is", "parameters": {"max_new_tokens": 40}}')]
    if adapter_names:
        example = "french" if "french" in adapter_names else adapter_names[0]
        lines += [f"Demo adapters (pbase repos of '{DEMO_TENANT}'): "
                  + ", ".join(f"{name}/1" for name in adapter_names) + "\nWith an adapter:\n",
                  # The demo adapters were trained on chat-formatted prompts.
                  curl("/generate", '{"inputs": "What is the capital of Italy?", "parameters": '
                       f'{{"max_new_tokens": 40, "adapter_id": "{example}/1", "apply_chat_template": true}}}}'),
                  f"OpenAI-compatible (the openai client: base_url={prefix}/v1, api_key=the token):\n",
                  curl("/v1/chat/completions", f'{{"model": "{example}/1", "max_tokens": 40, "messages": '
                       '[{"role": "user", "content": "What is the capital of Italy?"}]}')]
    sys.stdout.write("".join(lines))
    sys.stdout.flush()
