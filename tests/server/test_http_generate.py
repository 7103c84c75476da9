"""Generation over real HTTP: the three routes, SSE framing, headers, details, parameters."""
from __future__ import annotations

import json
import math

import httpx
import pytest

# One worker per module under xdist: its live server is started once.
pytestmark = pytest.mark.xdist_group("test_http_generate")

PROMPT = "The capital of France is"
GREEDY = {"max_new_tokens": 8, "details": True}


def post(live, path: str, body: dict, tenant: str = "demo") -> httpx.Response:
    return httpx.post(live.prefix(tenant) + path, json=body, headers=live.headers(tenant), timeout=60)


def sse_events(raw: bytes) -> list[dict]:
    """Parse an SSE body strictly: every event is exactly `data:<compact JSON>\\n\\n`."""
    assert raw.endswith(b"\n\n")
    events = []
    for block in raw[:-2].split(b"\n\n"):
        assert block.startswith(b"data:"), block
        payload = block[len(b"data:"):]
        event = json.loads(payload)
        assert payload == json.dumps(event, separators=(",", ":")).encode()
        events.append(event)
    return events


def test_generate_matches_the_hf_transformers_greedy_oracle(live, engine) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from lora_runtime.embedded import ensure_embedded_model

    response = post(live, "/generate", {"inputs": PROMPT, "parameters": GREEDY})
    assert response.status_code == 200, response.text
    body = response.json()
    model = AutoModelForCausalLM.from_pretrained(ensure_embedded_model(None), dtype=torch.float32)
    prompt_ids = engine.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    expected = model.generate(prompt_ids, max_new_tokens=8, do_sample=False)[0, prompt_ids.shape[1]:]
    assert [t["id"] for t in body["details"]["tokens"]] == expected.tolist()
    assert body["generated_text"] == engine.tokenizer.decode(expected, skip_special_tokens=False)


def test_generate_body_details_and_headers(live, engine) -> None:
    response = post(live, "/generate", {"inputs": PROMPT, "parameters": GREEDY})
    body, headers = response.json(), response.headers
    details = body["details"]
    num_prompt = len(engine.tokenizer(PROMPT)["input_ids"])
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 8
    assert details["prompt_tokens"] == num_prompt and details["seed"] is None
    assert details["prefill"] == [] and details["best_of_sequences"] is None
    for token in details["tokens"]:
        assert set(token) == {"id", "text", "logprob", "special", "skipped"}
        assert math.isfinite(token["logprob"]) and token["logprob"] <= 0
    assert "".join(t["text"] for t in details["tokens"]) == body["generated_text"]
    assert (headers["x-prompt-tokens"], headers["x-generated-tokens"]) == (str(num_prompt), "8")
    assert headers["x-total-tokens"] == str(num_prompt + 8)
    for name in ("x-total-time", "x-time-per-token", "x-queue-time", "x-time-to-first-token",
                 "x-validation-time", "x-inference-time"):
        assert float(headers[name]) >= 0, name
    assert float(headers["x-total-time"]) > 0
    assert headers["x-model-id"] == live.model_name and "x-adapter-id" in headers


def test_stream_framing_chunks_and_final_event(live) -> None:
    full = post(live, "/generate", {"inputs": PROMPT, "parameters": GREEDY}).json()
    response = post(live, "/generate_stream", {"inputs": PROMPT, "parameters": GREEDY})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["x-model-id"] == live.model_name
    assert "x-generated-tokens" not in response.headers
    events = sse_events(response.content)
    assert len(events) == 8
    for event in events[:-1]:
        assert event["generated_text"] is None and event["details"] is None
    assert events[-1]["generated_text"] == full["generated_text"]
    assert events[-1]["details"] == {"finish_reason": "length", "prompt_tokens":
                                     full["details"]["prompt_tokens"], "generated_tokens": 8, "seed": None}
    assert [e["token"] for e in events] == full["details"]["tokens"]


def test_base_route_answers_an_array_or_a_stream(live) -> None:
    single = post(live, "/generate", {"inputs": PROMPT, "parameters": GREEDY}).json()
    as_array = post(live, "", {"inputs": PROMPT, "parameters": GREEDY, "stream": False})
    assert as_array.status_code == 200 and as_array.json() == [single]
    assert as_array.headers["x-generated-tokens"] == "8"
    streamed = post(live, "", {"inputs": PROMPT, "parameters": GREEDY, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert sse_events(streamed.content)[-1]["generated_text"] == single["generated_text"]


def test_return_full_text_stop_sequence_and_seeded_sampling(live) -> None:
    full = post(live, "/generate", {"inputs": PROMPT, "parameters": {**GREEDY, "return_full_text": True}})
    plain = post(live, "/generate", {"inputs": PROMPT, "parameters": GREEDY}).json()
    assert full.json()["generated_text"] == PROMPT + plain["generated_text"]
    stop_word = plain["details"]["tokens"][2]["text"]
    stopped = post(live, "/generate", {"inputs": PROMPT, "parameters": {**GREEDY, "stop": [stop_word]}})
    assert stopped.json()["details"]["finish_reason"] == "stop_sequence"
    assert stopped.json()["generated_text"].endswith(stop_word)
    sampled = [post(live, "/generate", {"inputs": PROMPT, "parameters": {
        **GREEDY, "do_sample": True, "temperature": 1.5, "seed": 7}}).json() for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0]["details"]["seed"] == 7


def test_both_penalty_spellings_reach_the_engine(live) -> None:
    prompt = "one two one two one two one two"
    answers = [post(live, "/generate", {"inputs": prompt, "parameters": {**GREEDY, **extra}}).json()
               for extra in ({}, {"repetition_penalty": 5.0}, {"repitition_penalty": 5.0})]
    assert answers[1] == answers[2]
    assert answers[1]["generated_text"] != answers[0]["generated_text"]


def test_decoder_input_details(live) -> None:
    body = post(live, "/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 2, "details": True, "decoder_input_details": True}}).json()
    details = body["details"]
    assert details["prefill"][0]["logprob"] is None
    assert all(math.isfinite(t["logprob"]) for t in details["prefill"][1:])
    assert len(details["prefill"]) == details["prompt_tokens"]


def test_best_of_returns_the_other_candidates(live) -> None:
    body = post(live, "/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 4, "details": True, "best_of": 2, "do_sample": True}}).json()
    others = body["details"]["best_of_sequences"]
    assert len(others) == 1
    # Unseeded sampling (seed with best_of is refused): a candidate may draw EOS before its 4 tokens.
    other = others[0]
    assert other["generated_tokens"] == 4 or (other["finish_reason"] == "eos_token" and other["generated_tokens"] < 4)


@pytest.mark.parametrize("explicit_nulls", [True, False])
def test_explicit_nulls_are_accepted(live, explicit_nulls: bool) -> None:
    parameters = {"max_new_tokens": 4}
    if explicit_nulls:
        parameters |= {"adapter_id": None, "temperature": None, "top_k": None, "stop": [],
                       "seed": None, "best_of": None, "truncate": None, "response_format": None}
    response = post(live, "/generate", {"inputs": PROMPT, "parameters": parameters})
    assert response.status_code == 200, response.text


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.mark.parametrize("constraint", [{"schema": json.dumps(SCHEMA)},
                                        {"response_format": {"type": "json_object", "schema": SCHEMA}}])
def test_schema_constrains_the_output(live, constraint: dict) -> None:
    import jsonschema

    response = post(live, "/generate", {"inputs": "How many legs has a cat? Answer in JSON.",
                                        "parameters": {"max_new_tokens": 40, "details": True, **constraint}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["details"]["finish_reason"] == "eos_token"
    jsonschema.validate(json.loads(body["generated_text"]), SCHEMA)


def test_a_schema_that_cannot_compile_is_422_before_generation(live) -> None:
    response = post(live, "/generate_stream", {"inputs": "Hi", "parameters": {"schema": "{not json"}})
    assert response.status_code == 422 and response.json()["error_type"] == "validation"
    assert "schema" in response.json()["error"]
