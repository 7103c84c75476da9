"""The service on Ray Serve (2 engine replicas): adapter affinity, shared registry, client disconnects,
429 when every replica is full, per-replica metrics, and a replica killed mid-run (the official
clients: tests/cluster/test_clients_on_cluster.py). Tests may run in any order: the killing one
waits for Serve's replacement before it ends."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter, defaultdict

import httpx
import pytest

from server.client import Client
from tests.cluster.conftest import ADAPTERS, GROUP, MAX_IN_FLIGHT, Cluster
from benchmarks.loopback_s3 import s3_server

pytestmark = [GROUP, pytest.mark.slow]


def _replica(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.headers["x-replica-id"]


@pytest.fixture(scope="module")
def uploaded(cluster: Cluster) -> list[str]:
    """ADAPTERS uploaded through the ingress as pbase repos of tenant demo."""
    client = Client(cluster.base_url, cluster.token, "demo", cluster.model_name)
    with s3_server().without_authentication():  # the upload's presigned PUTs (benchmarks/loopback_s3.py)
        return [client.upload(cluster.adapter_dirs[name], name).adapter_id for name in ADAPTERS]


def test_adapter_requests_stick_to_one_replica(cluster: Cluster, uploaded: list[str]) -> None:
    """40 requests over 4 adapters, two at a time: each adapter's served by one replica (>= 90%)."""
    order = [uploaded[i % len(uploaded)] for i in range(40)]

    async def run() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(adapter_id: str) -> tuple[str, str]:
                body = {"inputs": "Hello", "parameters": {"max_new_tokens": 4, "adapter_id": adapter_id}}
                response = await client.post(cluster.prefix() + "/generate", json=body, headers=cluster.headers())
                return adapter_id, _replica(response)

            served = []
            for start in range(0, len(order), 2):
                served += await asyncio.gather(*(one(a) for a in order[start:start + 2]))
            return served

    by_adapter: dict[str, Counter] = defaultdict(Counter)
    for adapter_id, replica in asyncio.run(run()):
        by_adapter[adapter_id][replica] += 1
    for adapter_id, replicas in by_adapter.items():
        assert replicas.most_common(1)[0][1] >= 9, (adapter_id, replicas)
    held = {r["replica_id"]: set(r["adapters"]) for r in cluster.replicas()}
    for adapter_id, replicas in by_adapter.items():
        assert adapter_id in held[replicas.most_common(1)[0][0]]


def test_base_requests_spread_over_both_replicas(cluster: Cluster) -> None:
    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one() -> str:
                body = {"inputs": "Count: 1, 2,", "parameters": {"max_new_tokens": 16}}
                return _replica(await client.post(cluster.prefix() + "/generate", json=body, headers=cluster.headers()))

            return await asyncio.gather(*(one() for _ in range(2 * MAX_IN_FLIGHT)))

    assert len(set(asyncio.run(run()))) == 2


def test_an_uploaded_adapter_is_served_alike_by_both_replicas(cluster: Cluster, tmp_path) -> None:
    """Uploaded once through the ingress (PostgreSQL + S3), then more requests at once than one
    replica admits: both replicas serve it, with the same greedy tokens. Whether a burst overflows
    one replica depends on how fast the requests reach it against how fast it answers (one CI run saw
    a whole burst on one replica), so up to three bursts are sent."""
    import shutil

    directory = tmp_path / "fresh"
    shutil.copytree(cluster.adapter_dirs["a0"], directory)
    with s3_server().without_authentication():
        adapter_id = Client(cluster.base_url, cluster.token, "demo", cluster.model_name).upload(directory, "fresh").adapter_id

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"inputs": "The capital of France is",
                    "parameters": {"max_new_tokens": 24, "adapter_id": adapter_id, "details": True}}
            return await asyncio.gather(*(client.post(cluster.prefix() + "/generate", json=body, headers=cluster.headers())
                                          for _ in range(2 * MAX_IN_FLIGHT)))

    responses: list[httpx.Response] = []
    for _ in range(3):
        responses += asyncio.run(run())
        if len({_replica(response) for response in responses}) == 2:
            break
    assert len({_replica(response) for response in responses}) == 2
    assert len({json.dumps(r.json()["details"]["tokens"]) for r in responses}) == 1
    base = cluster.generate({"max_new_tokens": 24})
    assert base.json()["generated_text"] != responses[0].json()["generated_text"]


def test_every_replica_full_answers_429(cluster: Cluster) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 48}}
            return await asyncio.gather(*(client.post(cluster.prefix() + "/generate", json=body, headers=cluster.headers())
                                          for _ in range(2 * MAX_IN_FLIGHT + 4)))

    statuses = Counter(response.status_code for response in asyncio.run(run()))
    assert statuses[200] >= 2 * MAX_IN_FLIGHT and statuses[429] >= 1, statuses
    assert set(statuses) == {200, 429}


def _wait_until_idle(cluster: Cluster, replica: str | None = None, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while any(r["num_running"] for r in cluster.replicas() if replica in (None, r["replica_id"])):
        assert time.monotonic() < deadline, "a request still runs on its replica after its client left"
        time.sleep(0.2)


def test_a_client_leaving_aborts_its_request_on_the_replica(cluster: Cluster) -> None:
    """Streamed or not: 4000 tokens would take a minute; the request ends when its client leaves."""
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 4000, "ignore_eos_token": True}}
    with httpx.stream("POST", cluster.prefix() + "/generate_stream", json=body, headers=cluster.headers(),
                      timeout=120) as response:
        replica = response.headers["x-replica-id"]
        for _ in zip(range(3), response.iter_lines()):
            pass
    _wait_until_idle(cluster, replica)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.prefix() + "/generate", json=body, headers=cluster.headers(), timeout=1.0)
    _wait_until_idle(cluster)


def test_a_read_cancelled_mid_stream_leaves_the_request_for_abort_to_end(cluster: Cluster) -> None:
    """How a client's leaving reaches the ingress: its task is cancelled while it awaits the next
    token. `abort` must still cancel the request on its replica; the stream stays referenced here,
    so that nothing else (Ray dropping an unreferenced stream) can end it."""
    from ray import serve

    from lora_runtime.core import SamplingParams
    from server.cluster.app import APP_NAME
    from server.cluster.remote import RemoteEngine

    async def run() -> tuple[object, bool]:
        engines = serve.get_deployment_handle("EngineReplica", APP_NAME)
        engine = RemoteEngine(engines, serve.get_deployment_handle("ReplicaDirectory", APP_NAME),
                              await engines.info.remote())
        stream = await engine.add_request("Once upon a time", SamplingParams(max_new_tokens=4000, ignore_eos_token=True))
        for _ in range(100):  # until a read is cancelled while it waits (not after its token came)
            reader = asyncio.create_task(anext(stream))
            await asyncio.sleep(0)
            reader.cancel()
            try:
                await reader
            except asyncio.CancelledError:
                return stream, await stream.abort()
        pytest.fail("every read had its token before it could be cancelled")

    stream, aborted = asyncio.run(run())
    assert aborted
    _wait_until_idle(cluster, stream.replica_id)


def test_metrics_show_each_replica(cluster: Cluster) -> None:
    text = httpx.get(f"{cluster.base_url}/metrics", headers=cluster.headers(), timeout=30).text
    replicas = {r["replica_id"] for r in cluster.replicas()}
    for replica in replicas:
        assert f'lora_replica_num_running{{replica="{replica}"}}' in text
    assert "lora_engine_num_total_blocks" in text


def test_a_killed_replica_fails_its_requests_with_503_and_the_other_serves(cluster: Cluster, tmp_path) -> None:
    """A stream and a whole request of a fresh adapter run on the replica its first request chose;
    that replica is killed: both fail as `replica_unavailable`, the survivor serves the next one."""
    import shutil

    import ray

    shutil.copytree(cluster.adapter_dirs["a3"], tmp_path / "doomed")
    with s3_server().without_authentication():
        adapter = Client(cluster.base_url, cluster.token, "demo", cluster.model_name).upload(
            tmp_path / "doomed", "doomed").adapter_id
    _wait_until_idle(cluster)  # the reports read below then show this test's requests only
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 4000, "ignore_eos_token": True,
                                                         "adapter_id": adapter}}
    with httpx.stream("POST", cluster.prefix() + "/generate_stream", json=body, headers=cluster.headers(),
                      timeout=120) as stream:
        doomed = stream.headers["x-replica-id"]
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))

        def replica_state() -> dict:
            return next(r for r in cluster.replicas() if r["replica_id"] == doomed)

        deadline = time.monotonic() + 30
        while adapter not in replica_state()["adapters"]:  # held there: Serve routes its next request there
            assert time.monotonic() < deadline, "the adapter's replica never reported it"
            time.sleep(0.1)
        whole: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: whole.append(httpx.post(
            cluster.prefix() + "/generate", json=body, headers=cluster.headers(), timeout=120)))
        waiting.start()
        while replica_state()["num_running"] < 2:
            assert time.monotonic() < deadline, "the second request did not reach the adapter's replica"
            time.sleep(0.1)
        name = next(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                    if actor["name"].endswith(f"#{doomed}"))
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        events = [json.loads(line.removeprefix("data:")) for line in lines if line.startswith("data:")]
        waiting.join(60)
    assert events and events[-1]["error_type"] == "replica_unavailable"
    (answer,) = whole
    assert (answer.status_code, answer.json().get("error_type")) == (503, "replica_unavailable"), answer.text
    survivor = cluster.generate({"adapter_id": adapter})
    assert _replica(survivor) != doomed
    assert httpx.get(f"{cluster.base_url}/health", timeout=30).status_code == 200
    cluster.wait_for_replicas(2, gone=doomed)  # Serve has replaced it, for the tests that run after this one
