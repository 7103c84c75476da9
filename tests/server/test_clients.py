"""Real clients against the live server: lorax-client 0.6.3, text-generation 0.7.0, and ours."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import lorax
import lorax.errors
import pytest
import text_generation
import text_generation.errors

from server import client as ours
from tests.server.test_http_load import server_full

# One worker per module under xdist: its live server is started once.
pytestmark = pytest.mark.xdist_group("test_clients")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def reference(live) -> dict:
    """The server's own answer, through our client, that the other clients must reproduce."""
    answer = ours.Client(live.base_url, live.tokens["demo"], "demo", live.model_name).generate(
        PROMPT, max_new_tokens=6, details=True)
    return answer.model_dump()


@pytest.mark.parametrize("module", [lorax, text_generation], ids=["lorax", "text_generation"])
def test_official_clients_generate_and_stream(live, reference, module) -> None:
    client = module.Client(live.prefix(), headers=live.headers(), timeout=60)
    # text-generation always asks for details; lorax-client asks only when told.
    details = {"details": True} if module is lorax else {}
    answer = client.generate(PROMPT, max_new_tokens=6, **details)
    assert answer.generated_text == reference["generated_text"]
    assert answer.details.generated_tokens == 6
    assert [t.id for t in answer.details.tokens] == [t["id"] for t in reference["details"]["tokens"]]
    chunks = list(client.generate_stream(PROMPT, max_new_tokens=6, **details))
    assert [c.token.id for c in chunks] == [t["id"] for t in reference["details"]["tokens"]]
    assert chunks[-1].generated_text == reference["generated_text"]
    assert chunks[-1].details.generated_tokens == 6


@pytest.mark.parametrize("module", [lorax, text_generation], ids=["lorax", "text_generation"])
def test_official_clients_raise_their_typed_errors(live, module) -> None:
    client = module.Client(live.prefix(), headers=live.headers(), timeout=60)
    with pytest.raises(module.errors.ValidationError):
        client.generate(PROMPT, max_new_tokens=1_000_000)
    with pytest.raises(module.errors.ValidationError):
        list(client.generate_stream(PROMPT, max_new_tokens=1_000_000))
    missing = module.Client(live.prefix(deployment="no-such-model"), headers=live.headers())
    with pytest.raises(module.errors.NotFoundError):
        missing.generate(PROMPT, max_new_tokens=2)


def test_official_clients_raise_overloaded_when_the_server_is_full(live) -> None:
    with server_full(live):
        for module in (lorax, text_generation):
            with pytest.raises(module.errors.OverloadedError):
                module.Client(live.prefix(), headers=live.headers()).generate(PROMPT, max_new_tokens=2)
        with pytest.raises(ours.OverloadedError):
            ours.Client(live.base_url, live.tokens["demo"], "demo", live.model_name).generate(PROMPT)


def test_lorax_async_client(live, reference) -> None:
    async def run() -> str:
        client = lorax.AsyncClient(live.prefix(), headers=live.headers(), timeout=60)
        answer = await client.generate(PROMPT, max_new_tokens=6, details=True)
        return answer.generated_text

    assert asyncio.run(run()) == reference["generated_text"]


def test_our_clients_sync_and_async(live, reference) -> None:
    args = (live.base_url, live.tokens["demo"], "demo", live.model_name)
    chunks = list(ours.Client(*args).generate_stream(PROMPT, max_new_tokens=6, details=True))
    assert chunks[-1].generated_text == reference["generated_text"]
    assert chunks[-1].details.generated_tokens == 6

    async def run() -> tuple[str, str]:
        client = ours.AsyncClient(*args)
        answer = await client.generate(PROMPT, max_new_tokens=6)
        streamed = [chunk async for chunk in client.generate_stream(PROMPT, max_new_tokens=6)]
        return answer.generated_text, streamed[-1].generated_text

    assert asyncio.run(run()) == (reference["generated_text"], reference["generated_text"])


def test_our_client_raises_typed_errors(live) -> None:
    args = (live.base_url, live.tokens["demo"], "demo", live.model_name)
    with pytest.raises(ours.ValidationError) as refused:
        ours.Client(*args).generate(PROMPT, temperature=-1.0)
    assert refused.value.status == 422 and refused.value.error_type == "validation"
    assert "temperature" in refused.value.message
    with pytest.raises(ours.AuthenticationError):
        ours.Client(live.base_url, "wrong", "demo", live.model_name).generate(PROMPT)
    with pytest.raises(ours.ForbiddenError):
        list(ours.Client(live.base_url, live.tokens["other"], "demo", live.model_name).generate_stream(PROMPT))
    with pytest.raises(ours.NotFoundError):
        ours.Client(live.base_url, live.tokens["demo"], "demo", "nope").generate(PROMPT)


def test_text_generation_client_gets_tgis_grammar_top_tokens_and_frequency_penalty(live) -> None:
    from text_generation.types import Grammar, GrammarType

    client = text_generation.Client(live.prefix(), headers=live.headers(), timeout=60)
    date = client.generate("Today's date is", max_new_tokens=20,
                           grammar=Grammar(type=GrammarType.Regex, value="[0-9]{4}-[0-9]{2}-[0-9]{2}"))
    assert re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", date.generated_text)
    assert date.details.finish_reason.value == "eos_token"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    shaped = client.generate("Answer in JSON:", max_new_tokens=20, grammar=Grammar(type=GrammarType.Json, value=schema))
    jsonschema.validate(json.loads(shaped.generated_text), schema)

    answer = client.generate(PROMPT, max_new_tokens=4, top_n_tokens=3)
    assert len(answer.details.top_tokens) == 4
    for token, top in zip(answer.details.tokens, answer.details.top_tokens):
        assert len(top) == 3 and top[0].id == token.id  # greedy: the chosen token is the likeliest
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
    chunks = list(client.generate_stream(PROMPT, max_new_tokens=4, top_n_tokens=2))
    assert [len(c.top_tokens) for c in chunks] == [2, 2, 2, 2]

    # text-generation 0.7.0 refuses a frequency_penalty <= 0 before sending; TGI's server takes [-2, 2].
    plain = client.generate("la la la la la la", max_new_tokens=12).generated_text
    penalised = client.generate("la la la la la la", max_new_tokens=12, frequency_penalty=2.0).generated_text
    assert penalised != plain


def test_lorax_client_gets_alternative_tokens(live) -> None:
    client = lorax.Client(live.prefix(), headers=live.headers(), timeout=60)
    answer = client.generate(PROMPT, max_new_tokens=3, details=True, return_k_alternatives=2)
    for token in answer.details.tokens:
        assert len(token.alternative_tokens) == 2 and token.alternative_tokens[0].id == token.id
    plain = client.generate(PROMPT, max_new_tokens=3, details=True)
    assert all(token.alternative_tokens is None for token in plain.details.tokens)
