"""The service as a Ray Serve application: an ingress deployment serving the whole HTTP API (the app
of `python -m server`, over a `RemoteEngine`), an engine deployment of N replicas, and the replica
directory they report to. `application(args)` builds it from `python -m server.cluster`'s options;
`build_app` is the same for a Serve config file (`import_path: server.cluster.app:build_app`).

Ray Serve's defaults are set for a batching engine: a replica takes as many requests as the engine
admits (`max_ongoing_requests` = `--max-in-flight`; Serve's default is 5), the ingress admits the
replicas' sum and answers 429 past it, as the single server does past its own bound; Serve's
router refuses (429 too) only past a queue of that size. No `@serve.batch`: the engine batches
every step itself.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from server.app import create_app
from server.cluster import view
from server.cluster.remote import RemoteEngine
from server.cluster.replica import EngineReplica, ReplicaDirectory
from server.config import ServerConfig
from server.cpu_placement import allowed_cores, numa_nodes, split_cores
from server.db import open_database
from server.launch import add_service_options, engine_config, prepare_service, server_config
from server.registry.models import RegistryBase

APP_NAME = "lora"
# Ingress requests beyond the engines' sum that Serve lets in: control-plane calls, uploads, scrapes.
_CONTROL_HEADROOM = 64
# Seconds past the drain deadline before Serve kills a replica that is still busy.
_SHUTDOWN_MARGIN_S = 5


def cluster_parser(prog: str = "python -m server.cluster") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Serve the API from a Ray Serve cluster: an "
                                     "ingress and N engine replicas, adapter requests routed to replicas "
                                     "that hold their adapter.")
    add_service_options(parser)
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--replicas", type=int, default=2, help="engine replicas")
    cluster.add_argument("--address", default=None,
                         help="Ray cluster to join, e.g. ray://head:10001 or auto (default: start a local one)")
    cluster.add_argument("--threads-per-replica", type=int, default=None,
                         help="compute threads of each replica's engine (default: one per core of the replica's "
                              "own set of this machine's physical cores; with --address, the machine's CPUs / replicas)")
    cluster.add_argument("--replica-cpus", type=float, default=0.0,
                         help="CPUs Ray reserves for each engine replica (default 0: none, so that N replicas "
                              "start on a machine with fewer CPUs)")
    cluster.add_argument("--stream-interval", type=int, default=1,
                         help="generated tokens a replica sends the ingress in one message (default 1: each as it "
                              "comes; N: the first at once, then N at a time, each still its own event to the "
                              "client, for less CPU per token in the cluster's messaging)")
    return parser


def build_app(args: dict[str, Any]) -> Application:
    """The application for a Serve config file: `args` are `python -m server.cluster`'s options with
    underscores (`{"replicas": 2, "database_url": "postgresql://...", "registry_bucket": "adapters"}`)."""
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    # Serve places these replicas over the cluster's machines, not on the one building the app.
    return application(cluster_parser().parse_args(argv), replicas_on_this_machine=False)


def application(args: argparse.Namespace, replicas_on_this_machine: bool | None = None) -> Application:
    """`replicas_on_this_machine` (default: unless `--address` names a cluster): each replica then
    runs on a set of this machine's cores of its own (ValueError past one replica per core)."""
    if args.replicas < 1:
        raise ValueError("--replicas must be >= 1")
    if args.stream_interval < 1:
        raise ValueError("--stream-interval must be >= 1")
    if replicas_on_this_machine is None:
        replicas_on_this_machine = args.address is None
    core_sets = _replica_core_sets(args.replicas) if replicas_on_this_machine else None
    # Replicas run in other processes, possibly on other machines' working directories.
    for name in ("data_dir", "adapter_dir", "deployments", "demo_adapters"):
        if getattr(args, name) is not None:
            setattr(args, name, getattr(args, name).resolve())
    config = server_config(args)
    config.data_dir.mkdir(parents=True, exist_ok=True)
    # The schema (and SQLite's WAL mode) made once, here, before replicas open it concurrently.
    open_database(config.resolved_database_url, other_metadata=[RegistryBase.metadata]).dispose()
    engine = dataclasses.replace(engine_config(args), num_threads=_threads_per_replica(args, core_sets))
    # Its calls (two per replica a second) stay out of Serve's access log.
    directory = serve.deployment(ReplicaDirectory, num_replicas=1, ray_actor_options={"num_cpus": 0},
                                 logging_config={"enable_access_log": False}).bind()
    # The ingress admits what the replicas hold together (then 429 at once); the router's queue holds
    # as many, so that requests waiting the moment it takes to assign them are never refused for it.
    ingress_config = dataclasses.replace(config, max_in_flight=config.max_in_flight * args.replicas)
    engines = serve.deployment(
        EngineReplica, num_replicas=args.replicas, max_ongoing_requests=config.max_in_flight,
        max_queued_requests=ingress_config.max_in_flight, ray_actor_options={"num_cpus": args.replica_cpus},
        graceful_shutdown_timeout_s=config.shutdown_deadline_s + _SHUTDOWN_MARGIN_S,
    ).bind(config, engine, directory, core_sets, args.stream_interval)
    return serve.deployment(
        Ingress, max_ongoing_requests=ingress_config.max_in_flight + _CONTROL_HEADROOM,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=config.shutdown_deadline_s + _SHUTDOWN_MARGIN_S,
    ).bind(ingress_config, engines, directory)


def _replica_core_sets(num_replicas: int) -> tuple[tuple[int, ...], ...]:
    """A set of this process's physical cores for each replica (`split_cores`)."""
    return tuple(split_cores(allowed_cores(), numa_nodes(), num_replicas))


def _threads_per_replica(args: argparse.Namespace, core_sets: tuple[tuple[int, ...], ...] | None) -> int | None:
    """As given (`--threads-per-replica`, else `--threads`); else None where each replica has its own
    cores (one thread per core, the replica decides); else this machine's CPUs shared out."""
    threads = args.threads_per_replica or args.threads
    if threads is None and core_sets is None:
        threads = max(1, (os.cpu_count() or 1) // args.replicas)
    return threads


@serve.ingress()
class Ingress:
    """The HTTP API of `python -m server`, its engine the replicas: authenticates, validates and
    admits once, then hands each request to a replica."""

    def __init__(self, config: ServerConfig, engines: DeploymentHandle, directory: DeploymentHandle) -> None:
        self._config = config
        self._engines = engines
        self._directory = directory

    async def __serve_build_asgi_app__(self):
        config = self._config
        info = await self._engines.info.remote()
        database = open_database(config.resolved_database_url, other_metadata=[RegistryBase.metadata])
        adapters = await asyncio.to_thread(prepare_service, config, database, info)
        engine = RemoteEngine(self._engines, self._directory, info)
        app = create_app(config, engine, database, adapters)
        view.install(app, engine)
        return app
