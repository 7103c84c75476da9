"""The wire held still across refactors: the OpenAPI document and the status and JSON body of every
refusal in `BAD_REQUESTS`, on both wires (TGI/LoRAX routes and OpenAI routes), compared against
`snapshots/wire.json`, taken from the code before the runtime's contract moved to `lora_runtime.api`.

A change of the wire that is meant regenerates it: `python -m tests.server.test_wire_snapshot`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from tests.server.live import LiveServer, start_live_server

# One worker per module under xdist: its live server is started once.
pytestmark = pytest.mark.xdist_group("test_wire_snapshot")

SNAPSHOT = Path(__file__).parent / "snapshots" / "wire.json"
MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# (name, caller: "demo" | "other" | "none" | "wrong", method, route under the deployment ("" is
# the deployment itself) or absolute when it starts with "//", body: JSON value or raw bytes)
BAD_REQUESTS: list[tuple[str, str, str, str, object]] = [
    ("tgi no token", "none", "POST", "/generate", {"inputs": "hi"}),
    ("tgi wrong token", "wrong", "POST", "/generate", {"inputs": "hi"}),
    ("tgi other tenant", "other", "POST", "/generate", {"inputs": "hi"}),
    ("tgi unknown deployment", "demo", "POST", "//demo/deployments/v2/llms/no-such/generate", {"inputs": "hi"}),
    ("tgi foreign private", "demo", "POST", "//demo/deployments/v2/llms/other-private/generate",
     {"inputs": "hi"}),
    ("tgi not json", "demo", "POST", "/generate", b"{not json"),
    ("tgi list body", "demo", "POST", "/generate", [1, 2]),
    ("tgi empty body", "demo", "POST", "/generate", {}),
    ("tgi inputs int", "demo", "POST", "/generate", {"inputs": 5}),
    ("tgi inputs empty", "demo", "POST", "/generate", {"inputs": ""}),
    ("tgi parameters int", "demo", "POST", "/generate", {"inputs": "hi", "parameters": 3}),
    ("tgi max_new_tokens str", "demo", "POST", "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": "5"}}),
    ("tgi max_new_tokens 0", "demo", "POST", "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 0}}),
    ("tgi max_new_tokens huge", "demo", "POST", "/generate",
     {"inputs": "hi", "parameters": {"max_new_tokens": 1000000}}),
    ("tgi temperature", "demo", "POST", "/generate", {"inputs": "hi", "parameters": {"temperature": -1}}),
    ("tgi top_p", "demo", "POST", "/generate", {"inputs": "hi", "parameters": {"top_p": 0}}),
    ("tgi top_k", "demo", "POST", "/generate", {"inputs": "hi", "parameters": {"top_k": 0}}),
    ("tgi stop str", "demo", "POST", "/generate", {"inputs": "hi", "parameters": {"stop": "x"}}),
    ("tgi too many stops", "demo", "POST", "/generate",
     {"inputs": "hi", "parameters": {"stop": ["a", "b", "c", "d", "e"]}}),
    ("tgi best_of greedy", "demo", "POST", "/generate", {"inputs": "hi", "parameters": {"best_of": 2}}),
    ("tgi seed", "demo", "POST", "/generate", {"inputs": "hi", "parameters": {"seed": -1}}),
    ("tgi adapter path", "demo", "POST", "/generate", {"inputs": "hi", "parameters": {"adapter_id": "../repo/1"}}),
    ("tgi pbase unknown", "demo", "POST", "/generate", {"inputs": "hi", "parameters": {"adapter_id": "nope/1"}}),
    ("tgi pbase bad version", "demo", "POST", "/generate",
     {"inputs": "hi", "parameters": {"adapter_id": "nope/x", "adapter_source": "pbase"}}),
    ("tgi unknown source", "demo", "POST", "/generate",
     {"inputs": "hi", "parameters": {"adapter_id": "a/1", "adapter_source": "ftp"}}),
    ("tgi merged bad", "demo", "POST", "/generate",
     {"inputs": "hi", "parameters": {"merged_adapters": {"ids": ["a/1"], "weights": [1, 2]}}}),
    ("tgi merged unknown", "demo", "POST", "/generate",
     {"inputs": "hi", "parameters": {"merged_adapters": {"ids": ["a/1", "b/1"], "weights": [1, 1],
                                                          "merge_strategy": "linear"}}}),
    ("tgi response_format", "demo", "POST", "/generate",
     {"inputs": "hi", "parameters": {"response_format": {"type": "regex", "value": 3}}}),
    ("tgi stream best_of", "demo", "POST", "/generate_stream",
     {"inputs": "hi", "parameters": {"best_of": 2, "do_sample": True}}),
    ("tgi stream details", "demo", "POST", "/generate_stream",
     {"inputs": "hi", "parameters": {"decoder_input_details": True}}),
    ("tgi compat stream huge", "demo", "POST", "",
     {"inputs": "hi", "stream": True, "parameters": {"max_new_tokens": 1000000}}),
    ("tgi wrong method", "demo", "GET", "/generate", None),
    ("unknown route", "demo", "GET", "//nowhere", None),
    ("info no token", "none", "GET", "//info", None),
    ("repos no token", "none", "GET", "//v2/repos", None),
    ("repo unknown", "demo", "GET", "//v2/repos/no-such", None),
    ("repo version unknown", "demo", "GET", "//v2/repos/no-such/version/1", None),
    ("deployment unknown", "demo", "GET", "//v2/deployments/no-such", None),
    ("openai no token", "none", "POST", CHAT, {"model": "", "messages": MESSAGES}),
    ("openai other tenant", "other", "POST", CHAT, {"model": "", "messages": MESSAGES}),
    ("openai models wrong token", "wrong", "GET", "/v1/models", None),
    ("openai unknown deployment", "demo", "POST", "//demo/deployments/v2/llms/no-such" + COMPLETIONS,
     {"model": "", "prompt": "a"}),
    ("openai not json", "demo", "POST", CHAT, b"{not json"),
    ("openai no messages", "demo", "POST", CHAT, {"model": ""}),
    ("openai temperature", "demo", "POST", CHAT, {"model": "", "messages": MESSAGES, "temperature": 5}),
    ("openai max_tokens", "demo", "POST", CHAT, {"model": "", "messages": MESSAGES, "max_tokens": 10**7}),
    ("openai n greedy", "demo", "POST", CHAT, {"model": "", "messages": MESSAGES, "n": 2, "temperature": 0}),
    ("openai duplicate tools", "demo", "POST", CHAT, {"model": "", "messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}] * 2}),
    ("openai top_logprobs alone", "demo", "POST", CHAT, {"model": "", "messages": MESSAGES, "top_logprobs": 2}),
    ("openai tool message", "demo", "POST", CHAT, {"model": "", "messages": [{"role": "tool", "content": "x"}]}),
    ("openai role", "demo", "POST", CHAT, {"model": "", "messages": [{"role": "critic", "content": "x"}]}),
    ("openai unknown model", "demo", "POST", CHAT, {"model": "no-such/7", "messages": MESSAGES}),
    ("openai empty prompt", "demo", "POST", COMPLETIONS, {"model": "", "prompt": ["a", ""]}),
    ("openai suffix", "demo", "POST", COMPLETIONS, {"model": "", "prompt": "a", "suffix": "b"}),
    ("openai logit_bias", "demo", "POST", COMPLETIONS, {"model": "", "prompt": "a", "logit_bias": {"x": 1}}),
    ("openai stream max_tokens", "demo", "POST", COMPLETIONS,
     {"model": "", "prompt": "a", "stream": True, "max_tokens": 10**7}),
    ("openai response_format", "demo", "POST", CHAT,
     {"model": "", "messages": MESSAGES, "response_format": {"type": "json_schema"}}),
]


def _headers(live: LiveServer, caller: str) -> dict[str, str]:
    if caller == "none":
        return {}
    if caller == "wrong":
        return {"Authorization": "Bearer lrs_" + "A" * 43}
    return live.headers(caller)


def _url(live: LiveServer, route: str) -> str:
    return live.base_url + route[1:] if route.startswith("//") else live.prefix() + route


def answer(live: LiveServer, caller: str, method: str, route: str, body: object) -> dict:
    """The status and JSON body the server gives, the model's name and the server's address as
    placeholders (they differ between machines)."""
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    headers = {**_headers(live, caller), "Content-Type": "application/json"}
    response = httpx.request(method, _url(live, route), content=content, headers=headers, timeout=60)
    text = response.text.replace(live.base_url, "http://SERVER").replace(live.model_name, "MODEL")
    return {"status": response.status_code, "body": json.loads(text)}


def openapi_document(live: LiveServer) -> dict:
    text = httpx.get(live.base_url + "/openapi.json").text
    return json.loads(text.replace(live.model_name, "MODEL"))


def take_snapshot(live: LiveServer) -> dict:
    errors = {name: answer(live, *request) for name, *request in BAD_REQUESTS}
    return {"openapi": openapi_document(live), "errors": errors}


@pytest.fixture(scope="module")
def live(engine, tmp_path_factory):
    server = start_live_server(engine, tmp_path_factory.mktemp("wire"), max_new_tokens_limit=64)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def snapshot() -> dict:
    return json.loads(SNAPSHOT.read_text())


def test_the_openapi_document_is_the_snapshot(live, snapshot) -> None:
    assert openapi_document(live) == snapshot["openapi"]


@pytest.mark.parametrize("request_", BAD_REQUESTS, ids=[request[0] for request in BAD_REQUESTS])
def test_every_refusal_is_the_snapshot(live, snapshot, request_) -> None:
    name, *request = request_
    got = answer(live, *request)
    assert got["status"] >= 400, got
    assert got == snapshot["errors"][name]


def main() -> None:
    from lora_runtime import Engine, EngineConfig
    from lora_runtime.embedded import ensure_embedded_model
    import tempfile

    engine = Engine.from_config(EngineConfig(model=str(ensure_embedded_model()), dtype="float32"))  # as conftest.py
    with tempfile.TemporaryDirectory() as data_dir:
        server = start_live_server(engine, Path(data_dir), max_new_tokens_limit=64)
        try:
            SNAPSHOT.write_text(json.dumps(take_snapshot(server), indent=1, sort_keys=True) + "\n")
        finally:
            server.stop()
    sys.stdout.write(f"wrote {SNAPSHOT}\n")


if __name__ == "__main__":
    main()
