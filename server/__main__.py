"""`python -m server`: run the service, or manage tenants and tokens.

    python -m server [--host H] [--port P] [--data-dir DIR] [--deployments FILE] [--model DIR]
    python -m server tokens create --tenant NAME
    python -m server tenants list

The only module that reads environment variables: `DATABASE_URL` (any SQLAlchemy URL; default
SQLite in the data directory). On a first start with an empty database it creates tenant `demo`,
prints its token once and writes it to `DIR/demo-token`.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from server.config import ServerConfig
from server.db import Database, open_database
from server.tenancy import create_tenant, create_token, list_tenants

logger = logging.getLogger("server")
DEMO_TENANT = "demo"
DEMO_TOKEN_FILE = "demo-token"
_DEFAULTS = ServerConfig()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m server", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--data-dir", type=Path, default=Path(".data"))
    parser.add_argument("--deployments", type=Path, default=None,
                        help="TOML file of private deployments (default: DIR/deployments.toml if present)")
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--dtype", default=None, help="model dtype, e.g. float32 or bfloat16")
    parser.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda")
    parser.add_argument("--max-in-flight", type=int, default=_DEFAULTS.max_in_flight)
    parser.add_argument("--max-body-bytes", type=int, default=_DEFAULTS.max_body_bytes)
    parser.add_argument("--shutdown-deadline", type=float, default=_DEFAULTS.shutdown_deadline_s)
    commands = parser.add_subparsers(dest="command")
    tokens = commands.add_parser("tokens").add_subparsers(dest="action", required=True)
    tokens.add_parser("create").add_argument("--tenant", required=True)
    tenants = commands.add_parser("tenants").add_subparsers(dest="action", required=True)
    tenants.add_parser("list")
    return parser


def _config(args: argparse.Namespace) -> ServerConfig:
    deployments = args.deployments
    if deployments is None and (args.data_dir / "deployments.toml").exists():
        deployments = args.data_dir / "deployments.toml"
    return ServerConfig(host=args.host, port=args.port, data_dir=args.data_dir,
                        database_url=os.environ.get("DATABASE_URL") or None,
                        deployments_file=deployments, max_in_flight=args.max_in_flight,
                        max_body_bytes=args.max_body_bytes,
                        shutdown_deadline_s=args.shutdown_deadline)


def _create_token(database: Database, tenant: str) -> None:
    create_tenant(database, tenant)
    sys.stdout.write(create_token(database, tenant) + "\n")


def _ensure_demo_tenant(database: Database, data_dir: Path) -> str | None:
    """On an empty database: tenant `demo` and a token, written to DIR/demo-token (mode 0600)."""
    if list_tenants(database):
        return None
    create_tenant(database, DEMO_TENANT)
    token = create_token(database, DEMO_TENANT)
    token_file = data_dir / DEMO_TOKEN_FILE
    token_file.touch(mode=0o600)
    token_file.write_text(token + "\n")
    return token


def _serve(args: argparse.Namespace, config: ServerConfig, database: Database) -> None:
    from lora_runtime import Engine, EngineConfig
    from server.app import DrainingServer, create_app
    from server.deployments import read_deployments_file, register_deployments

    demo_token = _ensure_demo_tenant(database, config.data_dir)
    options = (("model", args.model), ("dtype", args.dtype), ("device", args.device))
    engine_options = {key: value for key, value in options if value is not None}
    engine = Engine.from_config(EngineConfig(**engine_options))
    private = read_deployments_file(config.deployments_file) if config.deployments_file else []
    register_deployments(database, [engine.model_name], private)
    if demo_token is not None:
        _announce_demo(config, engine.model_name, demo_token)
    DrainingServer(create_app(config, engine, database), config).run()


def _announce_demo(config: ServerConfig, model_name: str, token: str) -> None:
    # Shown once, on the terminal of whoever started the server: the token is not logged.
    token_file = config.data_dir / DEMO_TOKEN_FILE
    url = f"http://{config.host}:{config.port}/{DEMO_TENANT}/deployments/v2/llms/{model_name}/generate"
    sys.stdout.write(
        f"Created tenant '{DEMO_TENANT}'. Its token (also in {token_file}):\n  {token}\n"
        f"Try:\n  curl -s {url} -H \"Authorization: Bearer $(cat {token_file})\" "
        "-H 'Content-Type: application/json' "
        "-d '{\"inputs\": \"A LoRA adapter is\", \"parameters\": {\"max_new_tokens\": 40}}'\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    config = _config(args)
    config.data_dir.mkdir(parents=True, exist_ok=True)
    database = open_database(config.resolved_database_url)
    if args.command == "tokens":
        _create_token(database, args.tenant)
    elif args.command == "tenants":
        sys.stdout.write("".join(f"{name}\n" for name in list_tenants(database)))
    else:
        _serve(args, config, database)


if __name__ == "__main__":
    main()
