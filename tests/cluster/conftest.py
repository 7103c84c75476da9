"""One Ray Serve cluster for this package's tests (one xdist group, so one worker starts it once):
a local Ray instance, the service's application with 2 engine replicas of the embedded model
(float32, one thread each), the registry in a real PostgreSQL and its blobs in a bucket of the
loopback S3 server, as a multi-machine deployment keeps them."""
from __future__ import annotations

import importlib.util
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from lora_runtime.embedded import ensure_embedded_model
from server.db import open_database
from server.tenancy import create_tenant, create_token
from tests.fixtures.postgres import find_postgres_bin_dir, start_postgres
from benchmarks.loopback_s3 import REGION, s3_server
from tests.wiring.conftest import make_embedded_adapter

if importlib.util.find_spec("ray") is None:  # the cluster extra (pip install .[cluster]) is not installed
    collect_ignore_glob = ["test_*.py"]

GROUP = pytest.mark.xdist_group("cluster")
BUCKET = "cluster-registry"
MAX_IN_FLIGHT = 4  # per replica: small, so that the tests can fill a replica
# Outputs a replica sends in one message: above one, so that every streaming test here reads the
# ingress's unpacking of messages that carry several tokens.
STREAM_INTERVAL = 3
ADAPTERS = ("a0", "a1", "a2", "a3")


@dataclass
class Cluster:
    """The cluster's ingress, addressed as tests/server/live.py's `LiveServer` is (tenants `demo` and
    `other`), so that the single server's client tests run against it too."""

    base_url: str
    tokens: dict[str, str]
    model_name: str
    adapter_dirs: dict[str, Path]

    @property
    def token(self) -> str:
        return self.tokens["demo"]

    def prefix(self, tenant: str = "demo", deployment: str | None = None) -> str:
        return f"{self.base_url}/{tenant}/deployments/v2/llms/{deployment or self.model_name}"

    def headers(self, tenant: str = "demo") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[tenant]}"}

    def generate(self, parameters: dict, inputs: str = "The capital of France is", timeout_s: float = 120):
        body = {"inputs": inputs, "parameters": {"max_new_tokens": 4, "details": True, **parameters}}
        return httpx.post(self.prefix() + "/generate", json=body, headers=self.headers(), timeout=timeout_s)

    def replicas(self) -> list[dict]:
        response = httpx.get(f"{self.base_url}/cluster", headers=self.headers(), timeout=30)
        response.raise_for_status()
        return response.json()["replicas"]

    def wait_for_replicas(self, count: int, timeout_s: float = 180, gone: str | None = None) -> list[dict]:
        """Until `count` replicas report, none of them `gone` (a killed replica's last report stays
        listed a while, so counting alone can pass before its replacement serves)."""
        deadline = time.monotonic() + timeout_s
        while len(replicas := [r for r in self.replicas() if r["replica_id"] != gone]) != count:
            assert time.monotonic() < deadline, f"{len(replicas)} replicas reporting, not {count}"
            time.sleep(0.5)
        return replicas


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    import ray
    from ray import serve

    from server.cluster.app import APP_NAME, application, cluster_parser

    bin_dir = find_postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL binaries (initdb, pg_ctl) are not installed; run scripts/ensure_postgres.sh")
    postgres = start_postgres(bin_dir)
    s3 = s3_server()
    s3.client().create_bucket(Bucket=BUCKET)
    root = tmp_path_factory.mktemp("cluster")
    adapter_dirs = {name: make_embedded_adapter(root / name, seed=10 + i) for i, name in enumerate(ADAPTERS)}
    # The replicas are Ray workers: they read S3 credentials from the environment Ray starts them in.
    credentials = {"AWS_ACCESS_KEY_ID": s3.access_key_id, "AWS_SECRET_ACCESS_KEY": s3.secret_access_key,
                   "AWS_DEFAULT_REGION": REGION}
    port = _free_port()
    args = cluster_parser().parse_args([
        "--replicas", "2", "--threads-per-replica", "1", "--model", str(ensure_embedded_model()),
        "--dtype", "float32", "--port", str(port),
        "--data-dir", str(root / "data"), "--database-url", postgres.url, "--registry-bucket", BUCKET,
        "--s3-endpoint", s3.endpoint_url, "--max-in-flight", str(MAX_IN_FLIGHT), "--shutdown-deadline", "2",
        "--stream-interval", str(STREAM_INTERVAL)])
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": credentials},
             logging_level="warning", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(args), name=APP_NAME, route_prefix="/")
        tokens = {"demo": (root / "data" / "demo-token").read_text().strip()}
        database = open_database(postgres.url)
        create_tenant(database, "other")
        tokens["other"] = create_token(database, "other")
        database.dispose()
        info = httpx.get(f"http://127.0.0.1:{port}/info", headers={"Authorization": f"Bearer {tokens['demo']}"}).json()
        cluster = Cluster(f"http://127.0.0.1:{port}", tokens, info["base_models"][0], adapter_dirs)
        cluster.wait_for_replicas(2)
        yield cluster
    finally:
        serve.shutdown()
        ray.shutdown()
        postgres.stop()


@pytest.fixture(scope="session")
def live(cluster: Cluster) -> Cluster:
    """The cluster under the name the single server's tests use, for those run here unchanged."""
    return cluster
