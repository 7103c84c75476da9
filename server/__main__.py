"""`python -m server`: run the service, or manage tenants and tokens.

    python -m server [--host H] [--port P] [--data-dir DIR] [--database-url URL] [--deployments FILE]
                     [--model DIR] [--hub-endpoint URL] [--s3-endpoint URL] [--adapter-dir DIR] ...
    python -m server tokens create --tenant NAME
    python -m server tenants list

On a first start with an empty database it creates tenant `demo`, prints its token once and writes
it to `DIR/demo-token`, and registers the demo adapters (`demo_adapters/<name>/`) as its repos
`<name>` version 1 (server/launch.py). `python -m server.cluster` serves the same API from a Ray
Serve cluster.
"""
from __future__ import annotations

import argparse
import logging
import sys

from server.config import ServerConfig
from server.db import Database, open_database
from server.launch import add_service_options, engine_config, prepare_service, server_config
from server.registry.models import RegistryBase
from server.tenancy import create_tenant, create_token, list_tenants


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m server", description=__doc__.splitlines()[0])
    add_service_options(parser)
    commands = parser.add_subparsers(dest="command")
    tokens = commands.add_parser("tokens").add_subparsers(dest="action", required=True)
    tokens.add_parser("create").add_argument("--tenant", required=True)
    tenants = commands.add_parser("tenants").add_subparsers(dest="action", required=True)
    tenants.add_parser("list")
    return parser


def _create_token(database: Database, tenant: str) -> None:
    create_tenant(database, tenant)
    sys.stdout.write(create_token(database, tenant) + "\n")


def _serve(args: argparse.Namespace, config: ServerConfig, database: Database) -> None:
    from lora_runtime import AsyncEngine, Engine
    from server.adapter_sources import engine_adapter_sources
    from server.app import DrainingServer, create_app

    engine = Engine.from_config(engine_config(args), adapter_sources=engine_adapter_sources(config, database))
    adapters = prepare_service(config, database, engine.info)
    DrainingServer(create_app(config, AsyncEngine(engine), database, adapters), config).run()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    config = server_config(args)
    config.data_dir.mkdir(parents=True, exist_ok=True)
    database = open_database(config.resolved_database_url, other_metadata=[RegistryBase.metadata])
    if args.command == "tokens":
        _create_token(database, args.tenant)
    elif args.command == "tenants":
        sys.stdout.write("".join(f"{name}\n" for name in list_tenants(database)))
    else:
        _serve(args, config, database)


if __name__ == "__main__":
    main()
