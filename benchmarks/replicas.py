"""Replicas splitting one machine: `python -m server` (one engine) and `python -m server.cluster
--replicas N` (N engines, each pinned to its own cores), one after the other on the same machine:
the service's tokens per wall-second and CPU-seconds per token, and their ratios.

    python -m benchmarks.replicas                       # 1 thread vs 2 replicas of 1 thread, 3 rounds
    python -m benchmarks.replicas --replicas 4 --threads 4 --concurrency 32 --whole
    python -m benchmarks.replicas --cluster-concurrency 16  # the cluster at the single server's load

The single server gets `--threads` (default 1: the one core of each of 2 replicas on 2 cores) and
`--concurrency` streams; the cluster as many per replica (`--cluster-concurrency`), so that every
engine batches alike: a decode step reads all the weights whatever its batch, so half the batch on
each of two engines costs nearly twice the memory traffic per token. On a machine shared with other
work the wall ratio is noisy (each round prints how busy the rest of the machine was), while
CPU-seconds per token (every process of the service's tree: the Ray daemons, the proxy, the
ingress, the replicas) say what the cluster's own machinery costs.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from benchmarks import options
from benchmarks.serving import _free_port, _wait_healthy, adapter_picker, run_level, Target

logger = logging.getLogger("benchmarks.replicas")
_START_TIMEOUT_S = 900


@dataclass(frozen=True, slots=True)
class Round:
    service: str
    tokens_per_s: float
    cpu_s_per_token: float  # the service's whole process tree
    num_errors: int
    others_busy_cores: float  # the machine's busy CPU-seconds per wall-second, less this service's and ours


def _tree_cpu_s(process: psutil.Process) -> float:
    """CPU-seconds (user + system) of `process` and every living descendant."""
    total = 0.0
    for member in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = member.cpu_times()
            total += times.user + times.system
    return total


def _busy_s() -> float:
    """The machine's busy CPU-seconds since boot, all cores."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def _own_cpu_s() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


@contextlib.contextmanager
def _service(module: str, options: list[str], replicas: int) -> Iterator[tuple[Target, psutil.Process]]:
    """`python -m <module>` on a free port and a fresh data directory, healthy, its replicas reporting."""
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as data_dir:
        port = _free_port()
        command = [sys.executable, "-m", module, "--port", str(port), "--data-dir", data_dir, *options]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base_url = f"http://127.0.0.1:{port}"
            _wait_healthy(base_url, process, _START_TIMEOUT_S)
            token = (Path(data_dir) / "demo-token").read_text().strip()
            headers = {"Authorization": f"Bearer {token}"}
            if module == "server.cluster":
                _wait_replicas(base_url, headers, replicas)
            info = httpx.get(base_url + "/info", headers=headers).json()
            yield Target(base_url, token, "demo", info["base_models"][0]), psutil.Process(process.pid)
        finally:
            process.terminate()
            process.wait(120)


def _wait_replicas(base_url: str, headers: dict[str, str], count: int) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while len(httpx.get(base_url + "/cluster", headers=headers, timeout=30).json()["replicas"]) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} replicas reporting")
        time.sleep(0.5)


def _measure(name: str, target: Target, process: psutil.Process, concurrency: int, args: argparse.Namespace) -> Round:
    pick = adapter_picker([], "uniform", 1.0, 0)
    cpu_before, machine_before, own_before = _tree_cpu_s(process), _busy_s(), _own_cpu_s()
    num_requests = concurrency * args.requests_per_stream
    report = asyncio.run(run_level(target, concurrency, num_requests, args.max_new_tokens, pick, args.whole))
    num_tokens = report.output_tokens_per_s * report.wall_s
    cpu_s = _tree_cpu_s(process) - cpu_before
    others_s = _busy_s() - machine_before - cpu_s - (_own_cpu_s() - own_before)
    return Round(name, report.output_tokens_per_s, cpu_s / max(num_tokens, 1), sum(report.errors.values()),
                 max(0.0, others_s / report.wall_s))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replicas", description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    options.add_threads(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16, help="streams at once on the single server")
    parser.add_argument("--cluster-concurrency", type=int, default=None,
                        help="streams at once on the cluster (default: --concurrency per replica)")
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--whole", action="store_true", help="non-streamed generate requests")
    options.add_dtype(parser)
    parser.add_argument("--cluster-option", action="append", default=[],
                        help="an extra option of python -m server.cluster (repeatable), e.g. --cluster-option=--threads-per-replica=1")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = _parse_args(argv)
    cluster_concurrency = args.cluster_concurrency or args.concurrency * args.replicas
    # Each engine admits all its streams: the cluster's bound is per replica.
    single = ("server", ["--max-in-flight", str(args.concurrency), "--dtype", args.dtype, "--threads", str(args.threads)], 1)
    cluster = ("server.cluster", ["--max-in-flight", str(cluster_concurrency), "--dtype", args.dtype,
                                  "--replicas", str(args.replicas), *args.cluster_option], args.replicas)
    rounds: list[Round] = []
    # One service at a time: a cluster idling beside the single server would take its CPU.
    for name, service, concurrency in (("single", single, args.concurrency), ("cluster", cluster, cluster_concurrency)):
        with _service(*service) as (target, process):
            asyncio.run(run_level(target, 2, 4, 4, adapter_picker([], "uniform", 1.0, 0)))  # warm-up
            for index in range(args.rounds):
                rounds.append(_measure(name, target, process, concurrency, args))
                logger.info("round %d %-8s %7.1f tok/s  %.2f ms CPU/token (service), others busy %.2f "
                            "cores  errors %d", index, name, rounds[-1].tokens_per_s,
                            rounds[-1].cpu_s_per_token * 1e3, rounds[-1].others_busy_cores, rounds[-1].num_errors)
    _summarize(rounds, args)


def _summarize(rounds: list[Round], args: argparse.Namespace) -> None:
    def median(name: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in rounds if r.service == name)

    logger.info("cluster of %d replicas / one server of %d threads: throughput %.1f / %.1f tok/s (%.2fx, "
                "medians); CPU per token %.2f / %.2f ms (%.2fx)", args.replicas, args.threads,
                median("cluster", "tokens_per_s"), median("single", "tokens_per_s"),
                median("cluster", "tokens_per_s") / median("single", "tokens_per_s"),
                median("cluster", "cpu_s_per_token") * 1e3, median("single", "cpu_s_per_token") * 1e3,
                median("cluster", "cpu_s_per_token") / median("single", "cpu_s_per_token"))


if __name__ == "__main__":
    main()
