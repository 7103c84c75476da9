"""Every refusal over real HTTP has its status and the `{error, error_type}` body (docs/api.md 6, 7)."""
from __future__ import annotations

import httpx
import pytest

import kernels

# One worker per module under xdist: its live server is started once.
pytestmark = pytest.mark.xdist_group("test_http_errors")

BODY = {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}


def assert_error(response: httpx.Response, status: int, error_type: str, names: str = "") -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == error_type
    assert names in body["error"]


@pytest.mark.parametrize("route", ["/generate", "/generate_stream", ""])
def test_authentication_and_tenancy(live, route: str) -> None:
    url = live.prefix("demo") + route
    assert_error(httpx.post(url, json=BODY), 401, "authentication")
    assert_error(httpx.post(url, json=BODY, headers={"Authorization": "Basic abc"}), 401, "authentication")
    wrong = {"Authorization": "Bearer " + live.tokens["demo"][:-2] + "xx"}
    assert_error(httpx.post(url, json=BODY, headers=wrong), 401, "authentication")
    assert_error(httpx.post(url, json=BODY, headers=live.headers("other")), 403, "forbidden")


def test_deployments_unknown_private_and_foreign(live) -> None:
    def status_of(tenant: str, deployment: str) -> httpx.Response:
        return httpx.post(live.prefix(tenant, deployment) + "/generate", json=BODY,
                          headers=live.headers(tenant), timeout=60)

    assert_error(status_of("demo", "no-such-model"), 404, "not_found", "no-such-model")
    assert_error(status_of("demo", "other-private"), 403, "forbidden")
    own = status_of("demo", "demo-private")
    assert own.status_code == 200 and own.headers["x-model-id"] == live.model_name


def test_the_token_is_never_echoed_or_logged(live, caplog) -> None:
    wrong = "lrs_" + "A" * 43
    response = httpx.post(live.prefix() + "/generate", json=BODY, headers={"Authorization": f"Bearer {wrong}"})
    assert wrong not in response.text and wrong not in caplog.text
    assert live.tokens["demo"] not in caplog.text


@pytest.mark.parametrize(("content", "status", "error_type", "names"), [
    (b"{not json", 400, "bad_request", "JSON"),
    (b"[1, 2]", 400, "bad_request", "object"),
    (b'"text"', 400, "bad_request", "object"),
    (b"\xff\xfe", 400, "bad_request", "JSON"),
    (b"{}", 422, "validation", "inputs"),
    (b'{"inputs": 5}', 422, "validation", "inputs"),
    (b'{"inputs": ""}', 422, "validation", "inputs"),
    (b'{"inputs": "hi", "parameters": 3}', 422, "validation", "parameters"),
    (b'{"inputs": "hi", "parameters": {"max_new_tokens": "5"}}', 422, "validation", "max_new_tokens"),
    (b'{"inputs": "hi", "parameters": {"do_sample": "yes"}}', 422, "validation", "do_sample"),
    (b'{"inputs": "hi", "parameters": {"stop": "x"}}', 422, "validation", "stop"),
    (b'{"inputs": "hi", "parameters": {"temperature": -1}}', 422, "validation", "temperature"),
    (b'{"inputs": "hi", "parameters": {"top_p": 0}}', 422, "validation", "top_p"),
    (b'{"inputs": "hi", "parameters": {"top_k": 0}}', 422, "validation", "top_k"),
    (b'{"inputs": "hi", "parameters": {"max_new_tokens": 0}}', 422, "validation", "max_new_tokens"),
    (b'{"inputs": "hi", "parameters": {"max_new_tokens": 1000000}}', 422, "validation", "max_new_tokens"),
    (b'{"inputs": "hi", "parameters": {"stop": ["a", "b", "c", "d", "e"]}}', 422, "validation", "stop"),
    (b'{"inputs": "hi", "parameters": {"best_of": 2}}', 422, "validation", "best_of"),
    (b'{"inputs": "hi", "parameters": {"seed": -1}}', 422, "validation", "seed"),
    (b'{"inputs": "hi", "parameters": {"best_of": 2, "do_sample": true, "seed": 3}}', 422, "validation",
     "seed"),
    (b'{"inputs": "hi", "parameters": {"adapter_id": "../repo/1"}}', 422, "validation", "adapter_id"),
])
def test_malformed_bodies_and_bad_values(live, content: bytes, status: int, error_type: str,
                                         names: str) -> None:
    response = httpx.post(live.prefix() + "/generate", content=content, timeout=60,
                          headers={**live.headers(), "Content-Type": "application/json"})
    assert_error(response, status, error_type, names)


def test_stream_refusals_come_before_the_first_byte(live) -> None:
    for parameters, field in (({"best_of": 2, "do_sample": True}, "best_of"),
                              ({"decoder_input_details": True}, "decoder_input_details"),
                              ({"max_new_tokens": 1000000}, "max_new_tokens")):
        response = httpx.post(live.prefix() + "/generate_stream", headers=live.headers(), timeout=60,
                              json={"inputs": "hi", "parameters": parameters})
        assert_error(response, 422, "validation", field)


def test_unknown_routes_and_methods_keep_the_error_shape(live) -> None:
    assert_error(httpx.get(live.base_url + "/nowhere"), 404, "not_found")
    assert_error(httpx.get(live.prefix() + "/generate", headers=live.headers()), 405, "method_not_allowed")


def test_health_needs_no_token_and_info_needs_one(live) -> None:
    assert httpx.get(live.base_url + "/health").json() == {"status": "ok"}
    assert_error(httpx.get(live.base_url + "/info"), 401, "authentication")
    info = httpx.get(live.base_url + "/info", headers=live.headers()).json()
    names = {d["name"] for d in info["deployments"]}
    assert names == {live.model_name, "demo-private"}
    assert info["base_models"] == [live.model_name] and info["limits"]["max_in_flight"] == 4
    backend = kernels.backend_for("cpu")
    adapters = live.state.engine_info.config.adapters
    budget = live.state.engine_info.memory_budget
    assert info["runtime"].pop("memory_budget") == {
        "weights_bytes": budget.weights_bytes, "kv_cache_bytes": budget.kv_cache_bytes,
        "adapter_pool_bytes": budget.adapter_pool_bytes, "overhead_bytes": budget.overhead_bytes,
        "total_bytes": budget.total_bytes, "available_bytes": budget.available_bytes}
    assert budget.total_bytes == (budget.weights_bytes + budget.kv_cache_bytes + budget.adapter_pool_bytes
                                  + budget.overhead_bytes) <= budget.available_bytes
    assert info["runtime"] == {"dtype": "float32", "kernel_backend": backend.label,  # the live server runs float32
                               "threads": live.state.engine_info.num_threads,
                               "adapter_pool_bytes": adapters.device_pool_bytes,
                               "adapter_host_cache_bytes": adapters.host_cache_bytes,
                               # An app built without a placement (the library's, a cluster's ingress)
                               "engine_cpus": None, "service_cpus": None}


def test_a_tiny_temperature_is_not_a_server_error(live) -> None:
    response = httpx.post(live.prefix() + "/generate", headers=live.headers(), timeout=60, json={
        "inputs": "Hello", "parameters": {"max_new_tokens": 2, "do_sample": True, "temperature": 1e-300}})
    assert response.status_code in (200, 422), response.text
