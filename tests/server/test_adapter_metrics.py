"""The per-adapter series of /metrics (docs/api.md section 1) are keyed by the adapter's identity,
not by the spelling of its id, and their bound is per tenant. Oracle: prometheus_client's own parser
of the scrape, and the requests sent."""
from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lora_runtime import Engine
from lora_runtime.adapters.refs import AdapterRequest, Caller, parse_adapter_ref
from lora_runtime.config import AdapterConfig
from server.adapter_metrics import OVERFLOW_ADAPTER, AdapterCounters
from server.adapter_sources import engine_adapter_sources
from server.config import DEFAULT_DEMO_ADAPTERS_DIR, ServerConfig
from server.db import open_database
from tests.server.live import LiveServer, start_live_server

pytestmark = pytest.mark.xdist_group("test_adapter_metrics")

SPELLINGS = ("tiny", "./tiny", "tiny/../tiny")


@pytest.fixture(scope="module")
def live(engine, tmp_path_factory) -> Iterator[LiveServer]:
    """A server with an adapter directory holding the demo adapter `french` as `tiny`."""
    root = tmp_path_factory.mktemp("adapter-metrics")
    shutil.copytree(DEFAULT_DEMO_ADAPTERS_DIR / "french", root / "local" / "tiny",
                    ignore=shutil.ignore_patterns("README*"))
    data_dir = root / "data"
    data_dir.mkdir()
    database = open_database(f"sqlite:///{data_dir / 'state.db'}")  # the pbase source's
    sources = engine_adapter_sources(ServerConfig(data_dir=data_dir, adapter_dir=root / "local"), database)
    config = dataclasses.replace(engine.config, adapters=AdapterConfig(allow_local_paths=False))
    own_engine = Engine(config, engine.model, engine.tokenizer, engine.model_name, sources)
    server = start_live_server(own_engine, data_dir, adapter_dir=root / "local")
    yield server
    server.stop()
    own_engine.adapters.close()
    database.dispose()


def _adapter_requests(live: LiveServer) -> dict[tuple[str, str], float]:
    response = httpx.get(live.base_url + "/metrics", headers=live.headers(), timeout=30)
    assert response.status_code == 200, response.text
    families = {family.name: family for family in text_string_to_metric_families(response.text)}
    return {(s.labels["tenant"], s.labels["adapter"]): s.value for s in families["lora_adapter_requests"].samples}


def test_every_spelling_of_a_local_adapter_is_one_series(live) -> None:
    for adapter_id in SPELLINGS:
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 1, "adapter_id": adapter_id,
                                                  "adapter_source": "local"}}
        response = httpx.post(live.prefix() + "/generate", json=body, headers=live.headers(), timeout=120)
        assert response.status_code == 200, response.text
    series = {name: count for (tenant, name), count in _adapter_requests(live).items() if tenant == "demo"}
    assert series == {"tiny": len(SPELLINGS)}


def _request(tenant: str, adapter_id: str) -> AdapterRequest:
    return AdapterRequest(parse_adapter_ref(adapter_id), Caller(tenant))


def test_one_tenants_many_adapters_leave_the_others_their_own_series() -> None:
    counters = AdapterCounters(max_adapters=3)
    for index in range(10):
        counters.observe(_request("busy", f"repo{index}/1"), 1)
    counters.observe(_request("quiet", "mine/1"), 2)
    [requests, _] = counters.families(viewer=None)
    named = {(sample.labels["tenant"], sample.labels["adapter"]): sample.value for sample in requests.samples}
    assert named == {("busy", "repo0/1"): 1, ("busy", "repo1/1"): 1, ("busy", "repo2/1"): 1,
                     ("busy", OVERFLOW_ADAPTER): 7, ("quiet", "mine/1"): 1}
