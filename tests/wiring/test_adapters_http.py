"""Requests naming adapters from every source, over real HTTP: the tokens equal HF + PEFT's on the
same adapter files, each failure of docs/api.md section 3 has its status and error_type, and the
`x-adapter-*` headers name what was asked for."""
from __future__ import annotations

import pytest

from tests.wiring.conftest import GROUP, HUB_TOKEN

pytestmark = GROUP


def _token_ids(response) -> list[int]:
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


def _assert_error(response, status: int, error_type: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error_type"] == error_type


@pytest.mark.parametrize(("parameters", "source"), [
    ({"adapter_id": "org/adapter-a"}, "hub"),
    ({"adapter_id": "org/private-a", "api_token": HUB_TOKEN}, "hub"),
    ({"adapter_id": "s3://wiring-adapters/adapters/a"}, "s3"),
    ({"adapter_id": "wiring-adapters/adapters/a/", "adapter_source": "s3"}, "s3"),
    ({"adapter_id": "team/a", "adapter_source": "local"}, "local"),
])
def test_each_source_serves_the_adapter_as_peft_computes_it(wired, peft_oracle, parameters, source) -> None:
    response = wired.generate(parameters)
    assert _token_ids(response) == peft_oracle["a"] != peft_oracle["base"]
    assert response.headers["x-adapter-id"] == parameters["adapter_id"]
    assert response.headers["x-adapter-source"] == source


def test_merged_adapters_match_peft_linear_merge(wired, peft_oracle) -> None:
    merged = {"ids": ["org/adapter-a", "org/adapter-b"], "weights": [1.0, 0.5], "merge_strategy": "linear"}
    response = wired.generate({"merged_adapters": merged})
    assert _token_ids(response) == peft_oracle["merged"]
    assert response.headers["x-adapter-id"] == "org/adapter-a,org/adapter-b"
    assert response.headers["x-adapter-source"] == "merged"


def test_base_model_without_adapter(wired, peft_oracle) -> None:
    response = wired.generate({"adapter_id": ""})
    assert _token_ids(response) == peft_oracle["base"]
    assert response.headers["x-adapter-source"] == "base"


@pytest.mark.parametrize(("parameters", "status", "error_type"), [
    ({"adapter_id": "org/missing"}, 404, "adapter_not_found"),
    ({"adapter_id": "org/adapter-a@no-such-branch"}, 404, "adapter_not_found"),
    ({"adapter_id": "nothing-here/1"}, 404, "adapter_not_found"),
    ({"adapter_id": "s3://wiring-adapters/adapters/none"}, 404, "adapter_not_found"),
    ({"adapter_id": "team/none", "adapter_source": "local"}, 404, "adapter_not_found"),
    ({"adapter_id": "org/private-a"}, 403, "adapter_access"),
    ({"adapter_id": "org/private-a", "api_token": "hf_stranger"}, 403, "adapter_access"),
    ({"adapter_id": "org/adapter-tiny"}, 422, "adapter_incompatible"),
    ({"adapter_id": "org/broken"}, 422, "adapter_invalid"),
    ({"adapter_id": "down/adapter"}, 424, "adapter_unavailable"),
    ({"adapter_id": "../x"}, 422, "validation"),
    ({"adapter_id": "../a", "adapter_source": "local"}, 422, "validation"),
    ({"adapter_id": "org/a", "merged_adapters": {"ids": ["org/a"]}}, 422, "validation"),
    ({"merged_adapters": {"ids": ["org/adapter-a", "org/adapter-tiny"]}}, 422, "adapter_incompatible"),
])
def test_adapter_failures_have_their_own_status(wired, parameters, status, error_type) -> None:
    _assert_error(wired.generate(parameters), status, error_type)


def test_stream_fails_before_the_first_byte_and_names_the_adapter(wired) -> None:
    import httpx

    body = {"inputs": "hi", "parameters": {"adapter_id": "org/missing"}}
    response = httpx.post(wired.live.prefix() + "/generate_stream", json=body,
                          headers=wired.live.headers(), timeout=60)
    _assert_error(response, 404, "adapter_not_found")
    body["parameters"] = {"adapter_id": "org/adapter-a", "max_new_tokens": 2}
    with httpx.stream("POST", wired.live.prefix() + "/generate_stream", json=body,
                      headers=wired.live.headers(), timeout=60) as stream:
        assert stream.status_code == 200
        assert (stream.headers["x-adapter-id"], stream.headers["x-adapter-source"]) == ("org/adapter-a", "hub")
        assert "generated_text" in stream.read().decode()
