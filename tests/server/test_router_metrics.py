"""The metrics routers read from /metrics (docs/api.md section 1), parsed by prometheus_client's own
parser: the queue and KV-cache gauges, `lora_requests_info` while requests of several adapters run
and wait, the per-adapter counters and their bound, and who sees which adapter's series.

Each server here has its own engine on the shared model's weights, with this server's registry as
its `pbase` source and a device pool of exactly two pages per module: with `max_rank` 16 it holds two
adapters (the demo adapters have rank 8), so a third adapter's request waits while two run."""
from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lora_runtime import Engine
from lora_runtime.adapters.merge_request import MergedAdapters
from lora_runtime.adapters.page_tensors import bytes_per_page
from lora_runtime.adapters.refs import AdapterRequest, Caller, parse_adapter_ref
from lora_runtime.config import AdapterConfig, KVCacheConfig
from server.adapter_metrics import adapter_name
from server.config import DEFAULT_DEMO_ADAPTERS_DIR
from server.db import Database, open_database
from tests.server.live import LiveServer, pbase_engine, start_live_server

pytestmark = pytest.mark.xdist_group("test_router_metrics")

MAX_RANK = 16  # one page per module
MAX_RESIDENT = 2
# Long enough to stay running for the whole check; the test aborts them.
LONG = {"max_new_tokens": 1000, "ignore_eos_token": True}


def _engine(shared: Engine, data_dir: Path, database: Database) -> Engine:
    adapters = shared.adapters
    pool_bytes = MAX_RESIDENT * bytes_per_page(adapters.base_shape, adapters.page_tensors.layout.dtype)
    config = dataclasses.replace(
        shared.config, kv_cache=KVCacheConfig(memory_bytes=128 << 20),
        adapters=AdapterConfig(max_rank=MAX_RANK, device_pool_bytes=pool_bytes, allow_local_paths=False))
    return pbase_engine(shared, data_dir, database, config)


def _register(live: LiveServer, tenant: str, repo: str, demo_adapter: str, scratch: Path) -> None:
    """`demo_adapters/<demo_adapter>` as `repo/1` of `tenant` (the registry edits its input: a copy)."""
    copy = scratch / f"{tenant}-{repo}"
    shutil.copytree(DEFAULT_DEMO_ADAPTERS_DIR / demo_adapter, copy, ignore=shutil.ignore_patterns("README*"))
    live.state.adapters.registry.create_version(tenant, tenant, repo, copy)


def _serve(shared: Engine, root: Path, adapters: dict[tuple[str, str], str], **overrides) -> Iterator[LiveServer]:
    """A live server whose registry holds `adapters`: (tenant, repo) -> the demo adapter it is."""
    data_dir = root / "data"
    data_dir.mkdir()
    database = open_database(f"sqlite:///{data_dir / 'state.db'}")  # the pbase source's
    engine = _engine(shared, data_dir, database)
    live = start_live_server(engine, data_dir, **overrides)
    for (tenant, repo), demo_adapter in adapters.items():
        _register(live, tenant, repo, demo_adapter, root)
    yield live
    live.stop()
    engine.adapters.close()
    database.dispose()


def families_of(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def scrape(live: LiveServer, tenant: str) -> dict:
    return families_of(httpx.get(live.base_url + "/metrics", headers=live.headers(tenant), timeout=30))


def gauge(families: dict, name: str) -> float:
    [sample] = families[name].samples
    return sample.value


def requests_info(families: dict) -> dict[str, str]:
    [sample] = families["lora_requests_info"].samples
    return sample.labels


def adapter_counts(families: dict) -> dict[tuple[str, str], tuple[float, float]]:
    """(tenant, adapter) -> (requests, generated tokens)."""
    requests = {(s.labels["tenant"], s.labels["adapter"]): s.value for s in families["lora_adapter_requests"].samples}
    tokens = {(s.labels["tenant"], s.labels["adapter"]): s.value
              for s in families["lora_adapter_generated_tokens"].samples}
    assert requests.keys() == tokens.keys()
    return {series: (requests[series], tokens[series]) for series in requests}


def queue_is(families: dict, num_running: int, num_waiting: int) -> bool:
    return (gauge(families, "lora_engine_num_running"), gauge(families, "lora_engine_num_waiting")) == (
        num_running, num_waiting)


def wait_until_idle(live: LiveServer, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not queue_is(scrape(live, "demo"), 0, 0):
        assert time.monotonic() < deadline, "the engine did not become idle"
        time.sleep(0.05)


def hold(live: LiveServer, client: httpx.AsyncClient, tenant: str, adapter_id: str) -> asyncio.Task:
    """A long request in flight until its task is cancelled (the server then aborts it)."""
    body = {"inputs": "Count:", "parameters": {**LONG, "adapter_id": adapter_id}}
    return asyncio.create_task(client.post(live.prefix(tenant) + "/generate", json=body,
                                           headers=live.headers(tenant)))


async def scrape_until(live: LiveServer, client: httpx.AsyncClient, tenant: str, num_running: int,
                       num_waiting: int, timeout_s: float = 120) -> dict:
    """The first scrape whose queue gauges read `num_running` and `num_waiting`."""
    deadline = time.monotonic() + timeout_s
    while True:
        families = families_of(await client.get(live.base_url + "/metrics", headers=live.headers(tenant)))
        if queue_is(families, num_running, num_waiting):
            return families
        assert time.monotonic() < deadline, "the queue did not reach the expected sizes"
        await asyncio.sleep(0.05)


async def release(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def observe(live: LiveServer, tenant: str | None, adapter_id: str | None, num_tokens: int) -> None:
    adapter = None if adapter_id is None else AdapterRequest(parse_adapter_ref(adapter_id), Caller(tenant))
    live.state.metrics.observe_adapter_request(adapter, num_tokens)


def test_adapter_names_are_the_ids_clients_send() -> None:
    def name(adapter: object, **parse) -> str:
        if isinstance(adapter, str):
            adapter = parse_adapter_ref(adapter, **parse)
        return adapter_name(AdapterRequest(adapter, Caller("demo", "hf_token")).key)

    assert [name(adapter_id) for adapter_id in ("french/1@3", "org/name@v2", "s3://bucket/a/b")] == [
        "french/1@3", "org/name@v2", "s3://bucket/a/b"]
    merge = MergedAdapters(ids=("french/1", "org/name"), weights=(1.0, 0.5), merge_strategy="ties", density=0.5)
    assert name(merge) == "merge(french/1+org/name)"
    # Commas separate the names in lora_requests_info.
    assert name("team/a,b", adapter_source="local", allow_local=True) == "team/a%2Cb"
    # One adapter is one name, whatever the spelling of its id.
    local = {name(spelling, adapter_source="local", allow_local=True) for spelling in ("tiny", "./tiny", "tiny/../tiny")}
    assert local == {"tiny"}
    assert {name(spelling, adapter_source="s3") for spelling in ("bucket/a/b", "bucket/a/b/")} == {"s3://bucket/a/b"}
    assert name("french/1@03") == "french/1@3"


class TestEveryTenantReads:
    """No metrics tenant: each tenant reads /metrics and sees its own adapters' series."""

    @pytest.fixture(scope="class")
    def live(self, engine, tmp_path_factory) -> Iterator[LiveServer]:
        # The other tenant's repo is the demo adapter `shout` under a name of its own.
        adapters = {("demo", "french"): "french", ("demo", "json"): "json", ("demo", "shout"): "shout",
                    ("other", "secret"): "shout"}
        yield from _serve(engine, tmp_path_factory.mktemp("router-metrics"), adapters, metrics_max_adapters=2)

    def test_queue_and_kv_gauges_are_in_range(self, live) -> None:
        families = scrape(live, "demo")
        assert queue_is(families, 0, 0)
        assert 0 <= gauge(families, "lora_engine_kv_cache_usage_ratio") <= 1
        assert gauge(families, "lora_engine_max_resident_adapters") == MAX_RESIDENT
        assert requests_info(families) == {"running_lora_adapters": "", "waiting_lora_adapters": "",
                                           "max_lora": str(MAX_RESIDENT)}
        assert abs(gauge(families, "lora_requests_info") - time.time()) < 60

    # Before the test that runs requests: the bound's two series go to the first adapters counted.
    def test_adapter_counters_count_the_first_adapters_and_bound_the_rest(self, live) -> None:
        before = {tenant: adapter_counts(scrape(live, tenant)) for tenant in ("demo", "other")}
        for adapter_id, num_tokens in (("french/1", 3), ("json/1", 5), ("french/1", 4), ("shout/1", 6)):
            observe(live, "demo", adapter_id, num_tokens)
        observe(live, "other", "secret/1", 7)
        observe(live, None, None, 2)
        demo, other = (adapter_counts(scrape(live, tenant)) for tenant in ("demo", "other"))

        def added(view: dict, old: dict, series: tuple[str, str]) -> tuple[float, float]:
            now, then = view[series], old.get(series, (0, 0))
            return now[0] - then[0], now[1] - then[1]

        # The bound (2) is per tenant: demo's first two adapters take demo's, its later ones count in
        # demo's (other), and the other tenant's adapter still gets a series of its own.
        assert added(demo, before["demo"], ("demo", "french/1")) == (2, 7)
        assert added(demo, before["demo"], ("demo", "json/1")) == (1, 5)
        assert added(demo, before["demo"], ("demo", "(other)")) == (1, 6)
        assert added(other, before["other"], ("other", "secret/1")) == (1, 7)
        assert ("other", "(other)") not in other
        for view, old in ((demo, before["demo"]), (other, before["other"])):
            assert added(view, old, ("", "")) == (1, 2)  # the base model's series, everyone's
        # Each tenant sees its own adapters' series only.
        assert {tenant for tenant, _ in demo} == {"demo", ""} and {tenant for tenant, _ in other} == {"other", ""}

    def test_requests_info_lists_each_tenants_running_and_waiting_adapters(self, live) -> None:
        pool = live.state.async_engine.engine.adapters.pages
        assert pool.capacity_for_rank(MAX_RANK) == pool.num_pages == MAX_RESIDENT

        async def run() -> tuple[dict, dict]:
            async with httpx.AsyncClient(timeout=300) as client:
                running = [hold(live, client, "demo", adapter_id) for adapter_id in ("french/1", "json/1")]
                await scrape_until(live, client, "demo", 2, 0)
                # Every module's two pages are pinned by the running adapters: these two wait.
                waiting = [hold(live, client, "demo", "shout/1"), hold(live, client, "other", "secret/1")]
                demo = await scrape_until(live, client, "demo", 2, 2)
                other = await scrape_until(live, client, "other", 2, 2)
                await release(running + waiting)
                return demo, other

        demo, other = asyncio.run(run())
        assert requests_info(demo) == {"running_lora_adapters": "french/1,json/1",
                                       "waiting_lora_adapters": "shout/1", "max_lora": "2"}
        assert requests_info(other) == {"running_lora_adapters": "", "waiting_lora_adapters": "secret/1",
                                        "max_lora": "2"}
        for families in (demo, other):  # the figures that name no adapter are everyone's
            assert 0 < gauge(families, "lora_engine_kv_cache_usage_ratio") <= 1
        wait_until_idle(live)


class TestMetricsTenant:
    """`metrics_tenant` set: only its tokens read /metrics (403 for the others), seeing every series."""

    @pytest.fixture(scope="class")
    def live(self, engine, tmp_path_factory) -> Iterator[LiveServer]:
        adapters = {("demo", "french"): "french", ("other", "secret"): "shout"}
        yield from _serve(engine, tmp_path_factory.mktemp("router-metrics-tenant"), adapters,
                          metrics_tenant="demo", metrics_port=0)

    def test_only_the_metrics_tenant_reads_and_it_sees_every_tenants_adapters(self, live) -> None:
        refused = httpx.get(live.base_url + "/metrics", headers=live.headers("other"))
        assert (refused.status_code, refused.json()["error_type"]) == (403, "forbidden")
        observe(live, "other", "secret/1", 3)

        async def run() -> dict:
            async with httpx.AsyncClient(timeout=300) as client:
                tasks = [hold(live, client, "demo", "french/1"), hold(live, client, "other", "secret/1")]
                families = await scrape_until(live, client, "demo", 2, 0)
                await release(tasks)
                return families

        families = asyncio.run(run())
        assert requests_info(families)["running_lora_adapters"] == "french/1,secret/1"
        assert adapter_counts(families)[("other", "secret/1")] == (1, 3)
        wait_until_idle(live)

    def test_the_metrics_port_serves_every_series_without_a_token(self, live) -> None:
        observe(live, "other", "secret/1", 2)
        port = live.state.metrics_listener.port
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics")
        assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
        families = families_of(scraped)
        assert ("other", "secret/1") in adapter_counts(families)
        assert "max_lora" in requests_info(families)
        assert httpx.get(f"http://127.0.0.1:{port}/other").status_code == 404
