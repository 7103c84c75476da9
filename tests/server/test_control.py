"""The control-plane routes the predibase SDK calls: the current user and a deployment's record."""
from __future__ import annotations

import pytest

import httpx

from tests.server.test_http_errors import assert_error

# One worker per module under xdist: its live server is started once.
pytestmark = pytest.mark.xdist_group("test_control")


def test_current_user_is_the_tokens_tenant(live) -> None:
    assert_error(httpx.get(live.base_url + "/users/current"), 401, "authentication")
    for tenant in ("demo", "other"):
        user = httpx.get(live.base_url + "/users/current", headers=live.headers(tenant)).json()
        assert user["username"] == tenant and user["tenant"]["shortCode"] == tenant
        assert user["tenant"]["subscription"]["active"] is True
    first = httpx.get(live.base_url + "/users/current", headers=live.headers()).json()
    assert first["uuid"] == httpx.get(live.base_url + "/users/current", headers=live.headers()).json()["uuid"]


def test_deployment_records_shared_private_foreign_and_unknown(live, engine) -> None:
    def get(name: str) -> httpx.Response:
        return httpx.get(f"{live.base_url}/v2/deployments/{name}", headers=live.headers())

    shared = get(live.model_name).json()["data"]
    assert shared["name"] == live.model_name and shared["status"] == "ready"
    assert shared["model"] == {"name": live.model_name, "maxInputLength": engine.max_model_len - 1}
    private = get("demo-private").json()["data"]
    assert private["type"] == "private" and private["model"]["name"] == live.model_name
    assert_error(get("other-private"), 403, "forbidden")
    assert_error(get("nope"), 404, "not_found")
