"""The cross-tenant prefix probe over real HTTP, on both wires: a tenant sends another tenant's
prompt and reads `x-prompt-cached-tokens` / `usage.prompt_tokens_details.cached_tokens`. Each
tenant's prefix cache is its own (base model included) unless the operator shares the base model's;
`cache_salt` narrows it further, to the requests that send the same salt."""
from __future__ import annotations

import argparse
import dataclasses
import logging

import httpx
import openai
import pytest

from lora_runtime import Engine
from server.launch import add_service_options, engine_config
from tests.server.live import start_live_server

# One worker per module under xdist: its live servers are started once.
pytestmark = pytest.mark.xdist_group("test_prefix_isolation")

SECRET = "tenant-only-salt-3f9a"


def _document(topic: str) -> str:
    """A ~400-token prompt: what a probe would test for."""
    return f"Internal memo on {topic}. " + "The quarterly figures stay inside the company. " * 40


def _tgi_cached(live, tenant: str, inputs: str, **parameters) -> int:
    response = httpx.post(live.prefix(tenant) + "/generate", headers=live.headers(tenant), timeout=120,
                          json={"inputs": inputs, "parameters": {"max_new_tokens": 1, **parameters}})
    assert response.status_code == 200, response.text
    return int(response.headers["x-prompt-cached-tokens"])


def _client(live, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.prefix(tenant) + "/v1", api_key=live.tokens[tenant], max_retries=0,
                         timeout=120)


def _chat_cached(live, tenant: str, text: str, **extra) -> int:
    response = _client(live, tenant).chat.completions.with_raw_response.create(
        model=live.model_name, messages=[{"role": "system", "content": text}, {"role": "user", "content": "Hi"}],
        temperature=0, max_tokens=1, extra_body=extra or None)
    cached = response.parse().usage.prompt_tokens_details.cached_tokens
    assert response.headers["x-prompt-cached-tokens"] == str(cached)
    return cached


def _completion_cached(live, tenant: str, text: str, **extra) -> int:
    completion = _client(live, tenant).completions.create(model=live.model_name, prompt=text, temperature=0,
                                                          max_tokens=1, extra_body=extra or None)
    return completion.usage.prompt_tokens_details.cached_tokens


PROBES = {"tgi": _tgi_cached, "chat": _chat_cached, "completions": _completion_cached}


@pytest.fixture(scope="module")
def sharing(engine, tmp_path_factory):
    """A server started with the base model's prefix cache shared across tenants."""
    kv_cache = dataclasses.replace(engine.config.kv_cache, share_base_prefix_cache=True)
    shared = Engine(dataclasses.replace(engine.config, kv_cache=kv_cache), engine.model, engine.tokenizer,
                    engine.model_name)
    server = start_live_server(shared, tmp_path_factory.mktemp("sharing"))
    yield server
    server.stop()


@pytest.mark.parametrize("wire", ["tgi", "chat"])
@pytest.mark.parametrize("first, second", [("demo", "other"), ("other", "demo")], ids=["demo-first", "other-first"])
def test_another_tenants_prompt_is_never_reported_cached(live, wire: str, first: str, second: str) -> None:
    probe, text = PROBES[wire], _document(f"{wire} {first}")
    assert probe(live, first, text) == 0
    assert probe(live, first, text) > 300  # the positive control: the tenant's own prompt hits
    assert probe(live, second, text) == 0
    assert probe(live, second, text) > 300  # the second tenant's own blocks, from now on


@pytest.mark.parametrize("wire", ["tgi", "completions"])
def test_a_salt_isolates_from_unsalted_requests_and_other_salts(live, wire: str) -> None:
    probe, text = PROBES[wire], _document(f"salted {wire}")
    assert probe(live, "demo", text) == 0
    assert probe(live, "demo", text, cache_salt=SECRET) == 0
    assert probe(live, "demo", text, cache_salt=SECRET) > 300  # the same salt shares
    assert probe(live, "demo", text, cache_salt=SECRET + "-2") == 0
    assert probe(live, "other", text, cache_salt=SECRET) == 0  # the same salt in another tenant
    assert probe(live, "demo", text) > 300  # the unsalted chain is still there


def test_a_streams_salt_roots_its_blocks_too(live) -> None:
    text = _document("streamed")
    body = {"inputs": text, "parameters": {"max_new_tokens": 1, "cache_salt": SECRET}}
    with httpx.stream("POST", live.prefix() + "/generate_stream", json=body, headers=live.headers(),
                      timeout=120) as response:
        assert response.status_code == 200
        assert "data:" in response.read().decode()
    assert _tgi_cached(live, "demo", text) == 0
    assert _tgi_cached(live, "demo", text, cache_salt=SECRET) > 300


def test_with_the_base_model_shared_other_tenants_hit_and_are_told(sharing) -> None:
    text = _document("shared")
    assert _tgi_cached(sharing, "demo", text) == 0
    assert _chat_cached(sharing, "other", _document("shared chat")) == 0
    assert _tgi_cached(sharing, "other", text) > 300
    assert _chat_cached(sharing, "demo", _document("shared chat")) > 300
    assert _tgi_cached(sharing, "other", text, cache_salt=SECRET) == 0  # a salt still isolates
    assert _tgi_cached(sharing, "demo", text, cache_salt=SECRET) == 0  # in its tenant only, when guessed


BAD_SALTS = {"empty": "", "too-long": "s" * 257, "number": 5}


@pytest.mark.parametrize("salt", BAD_SALTS.values(), ids=BAD_SALTS.keys())
@pytest.mark.parametrize("route", ["/generate", "/generate_stream"])
def test_a_bad_salt_is_422_naming_the_field_on_the_tgi_routes(live, route: str, salt: object) -> None:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 1, "cache_salt": salt}}
    response = httpx.post(live.prefix() + route, json=body, headers=live.headers(), timeout=60)
    assert response.status_code == 422, response.text
    assert response.json()["error_type"] == "validation"
    assert "cache_salt" in response.json()["error"]


@pytest.mark.parametrize("salt", BAD_SALTS.values(), ids=BAD_SALTS.keys())
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_bad_salt_is_400_naming_the_field_on_the_openai_routes(live, route: str, salt: object) -> None:
    client = _client(live, "demo")
    with pytest.raises(openai.BadRequestError) as refused:
        if route == "chat":
            client.chat.completions.create(model=live.model_name, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=1, extra_body={"cache_salt": salt})
        else:
            client.completions.create(model=live.model_name, prompt="Hi", max_tokens=1,
                                      extra_body={"cache_salt": salt})
    assert "cache_salt" in refused.value.body["param"]


def test_the_salt_is_never_logged_nor_echoed(live, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    assert _tgi_cached(live, "demo", "Hello", cache_salt=SECRET) == 0
    long_secret = SECRET * 20  # past the bound: refused
    response = httpx.post(live.prefix() + "/generate", headers=live.headers(), timeout=60,
                          json={"inputs": "Hello", "parameters": {"cache_salt": long_secret}})
    assert response.status_code == 422 and SECRET not in response.text
    assert caplog.records and SECRET not in caplog.text
    assert SECRET not in httpx.get(live.base_url + "/metrics", headers=live.headers(), timeout=60).text


def test_the_operator_option_is_off_unless_named() -> None:
    parser = argparse.ArgumentParser()
    add_service_options(parser)
    assert not engine_config(parser.parse_args([])).kv_cache.share_base_prefix_cache
    assert engine_config(parser.parse_args(["--share-base-prefix-cache"])).kv_cache.share_base_prefix_cache
