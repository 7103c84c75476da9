"""`python -m server.cluster --replicas N [--database-url URL] [--registry-bucket B] [--address A]`:
the service on Ray Serve, on a local Ray instance started here unless `--address` names a cluster;
every option of `python -m server` applies. Runs until interrupted, then stops the application.

Every replica reads the registry and its blobs: on one machine the defaults (SQLite and blobs in the
data directory) are shared; across machines give a PostgreSQL URL and an S3 bucket.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading

from server.cluster.app import APP_NAME, application, cluster_parser
from server.launch import program_name


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = cluster_parser(program_name("server.cluster"))
    args = parser.parse_args(argv)
    import ray
    from ray import serve

    try:  # before Ray starts: a refused option (more replicas than cores) costs nothing
        app = application(args)
    except ValueError as error:
        parser.error(str(error))
    # Ray starts its workers at niceness 15, so that its daemons keep the CPU under load; here the
    # workers are the service (replicas, ingress, proxy): at 15 any other work on the machine would
    # take their cores first.
    local_start = {"_system_config": {"worker_niceness": 0}} if args.address is None else {}
    ray.init(address=args.address, include_dashboard=False, **local_start)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        sys.stdout.write(f"serving on http://{args.host}:{args.port} with {args.replicas} engine replicas\n")
        sys.stdout.flush()
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
