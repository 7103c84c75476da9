"""The cross-tenant prefix probe through the cluster's ingress: with tenant `demo`'s prompt cached on
every replica, tenant `other`'s first request with it on each replica finds nothing cached. (Base
requests go to either replica, so the probe covers both; the cache scope travels with the request.)"""
from __future__ import annotations

import httpx
import pytest

from tests.cluster.conftest import GROUP, Cluster

pytestmark = [GROUP, pytest.mark.slow]
MAX_TRIES = 40  # base requests pick a replica at random: 40 leave one unseen with odds 2**-39


def _cached_on(cluster: Cluster, tenant: str, inputs: str) -> tuple[str, int]:
    """The replica that served the request and the prompt tokens it found cached."""
    response = httpx.post(cluster.prefix(tenant) + "/generate", headers=cluster.headers(tenant), timeout=120,
                          json={"inputs": inputs, "parameters": {"max_new_tokens": 1}})
    assert response.status_code == 200, response.text
    return response.headers["x-replica-id"], int(response.headers["x-prompt-cached-tokens"])


def test_another_tenants_prompt_is_cached_on_no_replica(cluster: Cluster) -> None:
    text = "Internal memo on the merger. " + "The quarterly figures stay inside the company. " * 40
    warmed: dict[str, int] = {}  # replica -> the most `demo` found cached there: its own blocks
    for _ in range(MAX_TRIES):
        replica, cached = _cached_on(cluster, "demo", text)
        warmed[replica] = max(warmed.get(replica, 0), cached)
        if len(warmed) == 2 and min(warmed.values()) > 0:
            break
    assert len(warmed) == 2 and min(warmed.values()) > 300, warmed
    first_probe: dict[str, int] = {}  # replica -> what `other` found cached there the first time
    for _ in range(MAX_TRIES):
        replica, cached = _cached_on(cluster, "other", text)
        first_probe.setdefault(replica, cached)
        if len(first_probe) == 2:
            break
    assert first_probe == dict.fromkeys(warmed, 0)
