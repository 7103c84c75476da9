"""`python -m server`: run the service, or manage tenants and tokens.

    python -m server [--host H] [--port P] [--data-dir DIR] [--database-url URL] [--deployments FILE]
                     [--model DIR] [--hub-endpoint URL] [--s3-endpoint URL] [--adapter-dir DIR] ...
    python -m server tenants create|list|delete [NAME]
    python -m server tokens create --tenant NAME
    python -m server tokens list [--tenant NAME]
    python -m server tokens revoke --id ID | --token TOKEN

`--data-dir` and `--database-url` (the database the commands work on) go before or after the command
and its action, in any order. On a first start with an empty database the server creates tenant
`demo`, prints its token once and writes it to `DIR/demo-token`, and registers the demo adapters
(`demo_adapters/<name>/`) as its repos `<name>` version 1 (server/launch.py). `python -m
server.cluster` serves the same API from a Ray Serve cluster.
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from server.config import ServerConfig
from server.cpu_placement import pin_this_thread, service_placement
from server.db import Database, open_database
from server.launch import add_service_options, engine_config, prepare_service, program_name, server_config
from sqlalchemy import select

from server.registry.models import AdapterRepo, RegistryBase
from server.tenancy import (
    create_tenant,
    create_token,
    delete_tenant,
    list_tenants,
    list_tokens,
    revoke_token,
)

logger = logging.getLogger("server")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=program_name("server"), description=__doc__.splitlines()[0])
    add_service_options(parser)
    database = _database_options()
    commands = parser.add_subparsers(dest="command", metavar="{tenants,tokens}")
    tenants = commands.add_parser("tenants", parents=[database], help="create, list or delete tenants")
    actions = tenants.add_subparsers(dest="action", required=True)
    actions.add_parser("create", parents=[database], help="create a tenant").add_argument("name")
    actions.add_parser("list", parents=[database], help="the tenants, one a line")
    actions.add_parser("delete", parents=[database],
                       help="delete a tenant with its tokens and private deployments").add_argument("name")
    tokens = commands.add_parser("tokens", parents=[database], help="create, list or revoke tokens")
    actions = tokens.add_subparsers(dest="action", required=True)
    actions.add_parser("create", parents=[database], help="a new token, printed once (the tenant is "
                       "created if missing)").add_argument("--tenant", required=True)
    actions.add_parser("list", parents=[database], help="id, tenant and creation time of each token "
                       "(never the secret)").add_argument("--tenant", default=None)
    revoke = actions.add_parser("revoke", parents=[database], help="delete a token: it stops working at once")
    which = revoke.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", type=int, help="the id `tokens list` shows")
    which.add_argument("--token", help="the token itself")
    return parser


def _database_options() -> argparse.ArgumentParser:
    """`--data-dir` and `--database-url` again on each command and action, so they may come after it
    too; SUPPRESS keeps a value given before the command when they are not repeated."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS)
    options.add_argument("--database-url", default=argparse.SUPPRESS)
    return options


def _serve(args: argparse.Namespace, config: ServerConfig, database: Database) -> None:
    from lora_runtime import AsyncEngine, Engine
    from server.adapter_sources import engine_adapter_sources
    from server.app import DrainingServer, create_app

    placement = service_placement(args.threads)
    # Built on its own CPUs, the engine counts its compute threads from them (lora_runtime/threads.py).
    pin_this_thread(placement.engine_cpus)
    engine = Engine.from_config(engine_config(args), adapter_sources=engine_adapter_sources(config, database))
    pin_this_thread(placement.service_cpus)  # the event loop, and the threads it starts from here on
    logger.info("engine: %d compute threads on CPUs %s; the service's threads on %s", engine.num_threads,
                _cpu_list(placement.engine_cpus),
                "the same CPUs" if placement.is_shared else "CPUs " + _cpu_list(placement.service_cpus))
    adapters = prepare_service(config, database, engine.info)
    async_engine = AsyncEngine(engine, cpus=placement.engine_cpus)
    DrainingServer(create_app(config, async_engine, database, adapters, placement), config).run()


def _cpu_list(cpus: tuple[int, ...]) -> str:
    return ",".join(map(str, cpus))


def _create_tenant(args: argparse.Namespace, database: Database) -> None:
    create_tenant(database, args.name)


def _list_tenants(args: argparse.Namespace, database: Database) -> None:
    sys.stdout.write("".join(f"{name}\n" for name in list_tenants(database)))


def _delete_tenant(args: argparse.Namespace, database: Database) -> None:
    # Registry repos name their tenant without a foreign key: a tenant created later under the same
    # name would own them. They are deleted through the API, blobs included.
    repos = _repo_names(database, args.name)
    if repos:
        raise ValueError(f"tenant {args.name!r} still has adapter repos ({', '.join(repos)}): "
                         "delete them first (DELETE /v2/repos/{name} with one of its tokens)")
    if not delete_tenant(database, args.name):
        raise KeyError(f"no tenant {args.name!r}")


def _repo_names(database: Database, tenant: str) -> list[str]:
    # The table itself, not `server.registry.repos`, whose imports load torch: these commands start
    # in a second, not ten.
    with database.read() as session:
        query = select(AdapterRepo.name).where(AdapterRepo.tenant_id == tenant).order_by(AdapterRepo.name)
        return list(session.scalars(query))


def _create_token(args: argparse.Namespace, database: Database) -> None:
    create_tenant(database, args.tenant)
    sys.stdout.write(create_token(database, args.tenant) + "\n")


def _list_tokens(args: argparse.Namespace, database: Database) -> None:
    tokens = list_tokens(database, args.tenant)
    sys.stdout.write("".join(f"{token.id}\t{token.tenant}\t{token.created_at.isoformat()}\n" for token in tokens))


def _revoke_token(args: argparse.Namespace, database: Database) -> None:
    revoked = revoke_token(database, token_id=args.id, token=args.token)
    if revoked is None:
        raise KeyError("no such token")
    sys.stderr.write(f"revoked token {revoked.id} of tenant {revoked.tenant}\n")


Command = Callable[[argparse.Namespace, Database], None]
_COMMANDS: dict[tuple[str, str], Command] = {
    ("tenants", "create"): _create_tenant, ("tenants", "list"): _list_tenants,
    ("tenants", "delete"): _delete_tenant, ("tokens", "create"): _create_token,
    ("tokens", "list"): _list_tokens, ("tokens", "revoke"): _revoke_token,
}


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    config = server_config(args)
    config.data_dir.mkdir(parents=True, exist_ok=True)
    database = open_database(config.resolved_database_url, other_metadata=[RegistryBase.metadata])
    if args.command is None:
        _serve(args, config, database)
        return
    try:
        _COMMANDS[args.command, args.action](args, database)
    except (KeyError, ValueError) as error:  # an unknown or malformed name: told, not a traceback
        sys.exit(f"python -m server {args.command} {args.action}: {error.args[0]}")
    finally:
        database.dispose()


if __name__ == "__main__":
    main()
