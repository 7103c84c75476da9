"""Replicas that split one machine: on the package's cluster (2 replicas, a local Ray instance) each
replica's process, every thread of it, runs on a physical core of its own; more replicas than
cores are refused before Ray starts; a Serve config file's replicas, placed by Serve over the
cluster's machines, are not split over the building machine's cores; and the command's replicas
run at normal priority."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from lora_runtime.embedded import ensure_embedded_model
from lora_runtime.threads import physical_cores
from tests.cluster.conftest import GROUP, Cluster

REPO_ROOT = Path(__file__).resolve().parents[2]


def _engine_replicas() -> list[psutil.Process]:
    """This test process's Ray workers that serve an engine replica (Ray names them by their actor)."""
    return [process for process in psutil.Process().children(recursive=True)
            if "EngineReplica" in " ".join(process.cmdline())]


@GROUP
def test_each_replica_and_all_its_threads_run_on_a_core_of_its_own(cluster: Cluster) -> None:
    cluster.wait_for_replicas(2)
    replicas = _engine_replicas()
    assert len(replicas) == 2
    masks = []
    for replica in replicas:
        threads = {frozenset(os.sched_getaffinity(thread.id)) for thread in replica.threads()}
        assert len(threads) == 1, f"one mask for every thread of the replica: {threads}"
        masks.append(threads.pop())
    cores = physical_cores(os.sched_getaffinity(0))
    assert sorted(masks, key=min) == [frozenset({core}) for core in cores[:2]]


def test_more_replicas_than_cores_are_refused_before_ray_starts(tmp_path: Path) -> None:
    num_cores = len(physical_cores(os.sched_getaffinity(0)))
    done = subprocess.run([sys.executable, "-m", "server.cluster", "--replicas", str(num_cores + 1),
                           "--data-dir", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"{num_cores + 1} replicas need a physical core each; this process may use {num_cores}" in done.stderr


def test_a_serve_config_files_replicas_are_not_split_over_this_machine(tmp_path: Path) -> None:
    from ray.serve import Application

    from server.cluster.app import build_app

    num_cores = len(physical_cores(os.sched_getaffinity(0)))
    app = build_app({"replicas": num_cores + 1, "data_dir": str(tmp_path)})
    assert isinstance(app, Application)


def test_the_command_runs_its_replica_at_normal_priority_on_every_core(tmp_path: Path) -> None:
    """`python -m server.cluster --replicas 1` as a user starts it: its one replica on all of the
    machine's physical cores, one compute thread each (in `/info`), not at Ray's niceness 15."""
    port = _free_port()
    command = [sys.executable, "-m", "server.cluster", "--replicas", "1", "--port", str(port),
               "--model", str(ensure_embedded_model()), "--dtype", "float32", "--data-dir", str(tmp_path / "data"),
               "--demo-adapters", str(tmp_path / "none")]
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "OMP_NUM_THREADS", "RAY_ADDRESS")}
    output = tmp_path / "output.txt"
    with output.open("w") as sink:  # Ray's own log lines too: a file never fills as a pipe does
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        _wait_for(process, output, "serving on", timeout_s=600)
        token = (tmp_path / "data" / "demo-token").read_text().strip()
        info = httpx.get(f"http://127.0.0.1:{port}/info", headers={"Authorization": f"Bearer {token}"}, timeout=60)
        (replica,) = [child for child in psutil.Process(process.pid).children(recursive=True)
                      if "EngineReplica" in " ".join(child.cmdline())]
        niceness, cpus = replica.nice(), set(replica.cpu_affinity())
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(120)
    cores = physical_cores(os.sched_getaffinity(0))
    assert niceness == 0 and cpus == set(cores)
    assert info.json()["runtime"]["threads"] == len(cores)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(process: subprocess.Popen, output: Path, marker: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while marker not in output.read_text(errors="replace"):
        assert process.poll() is None, "the cluster exited:\n" + output.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"no {marker!r} from the cluster"
        time.sleep(0.5)
