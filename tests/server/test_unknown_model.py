"""A model name that no source of this server can serve (`llama-3-8b`, typed out of habit, on a server
without a hub) is 404 `model_not_found` on both wires, naming the deployment's base model and the
route that lists its adapters; oracles: the `openai` client's own `NotFoundError`, the TGI error
shape, and that listing route answering."""
from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.xdist_group("test_unknown_model")

UNKNOWN = "llama-3-8b"
MESSAGES = [{"role": "user", "content": "Hello"}]


def _client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.prefix() + "/v1", api_key=live.tokens["demo"], max_retries=0, timeout=60)


def _models_path(live) -> str:
    return f"/demo/deployments/v2/llms/{live.model_name}/v1/models"


def _names_the_way_out(live, message: str) -> None:
    assert repr(UNKNOWN) in message and repr(live.model_name) in message
    assert f"GET {_models_path(live)}" in message


@pytest.mark.parametrize("call", [
    lambda client: client.chat.completions.create(model=UNKNOWN, messages=MESSAGES, max_tokens=2),
    lambda client: list(client.chat.completions.create(model=UNKNOWN, messages=MESSAGES, max_tokens=2,
                                                       stream=True)),
    lambda client: client.completions.create(model=UNKNOWN, prompt="Hello", max_tokens=2),
], ids=["chat", "chat-stream", "completions"])
def test_the_openai_client_raises_not_found(live, call) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        call(_client(live))
    error = raised.value.body
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert error["message"].startswith(f"model: {UNKNOWN!r} ")
    _names_the_way_out(live, error["message"])


@pytest.mark.parametrize("route", ["/generate", "/generate_stream", ""])
def test_the_tgi_routes_answer_404_in_their_shape(live, route: str) -> None:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2, "adapter_id": UNKNOWN}}
    response = httpx.post(live.prefix() + route, json=body, headers=live.headers(), timeout=60)
    assert response.status_code == 404, response.text
    answer = response.json()
    assert set(answer) == {"error", "error_type"} and answer["error_type"] == "model_not_found"
    assert answer["error"].startswith(f"adapter_id: {UNKNOWN!r} ")
    _names_the_way_out(live, answer["error"])


def test_the_named_route_lists_the_base_model_and_the_server_keeps_serving(live) -> None:
    listed = httpx.get(live.base_url + _models_path(live), headers=live.headers(), timeout=60)
    assert listed.status_code == 200 and live.model_name in {card["id"] for card in listed.json()["data"]}
    completion = _client(live).completions.create(model=live.model_name, prompt="Hello", max_tokens=2)
    assert completion.usage.completion_tokens == 2
