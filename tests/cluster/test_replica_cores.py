"""Replicas that split one machine: on the package's cluster (2 replicas, a local Ray instance) each
replica's process, every thread of it, runs on a physical core of its own; more replicas than
cores are refused before Ray starts; a Serve config file's replicas, placed by Serve over the
cluster's machines, are not split over the building machine's cores."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

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
