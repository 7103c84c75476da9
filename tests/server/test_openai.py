"""The unmodified `openai` client against a live server (docs/api.md section 8).

Oracles: the TGI routes' answers for the same prompt, adapter and parameters (themselves checked
against transformers and PEFT elsewhere), the chat template as transformers renders it, `jsonschema`
for structured output, and the client's own typed exceptions for errors."""
from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lora_runtime.embedded import ensure_embedded_model
from server.config import DEFAULT_DEMO_ADAPTERS_DIR
from server.db import open_database
from server.demo import register_demo_adapters
from tests.server.live import pbase_engine, start_live_server
from tests.server.test_http_load import engine_is_idle, server_full, wait_until

# One worker per module under xdist: its live server is started once.
pytestmark = pytest.mark.xdist_group("test_openai")

MESSAGES = [{"role": "system", "content": "You are brief."},
            {"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def live(engine, tmp_path_factory):
    """A server whose registry holds the demo adapters for tenant `demo`, as `make serve`'s does."""
    data_dir = tmp_path_factory.mktemp("openai")
    database = open_database(f"sqlite:///{data_dir / 'state.db'}")  # the pbase source's
    own_engine = pbase_engine(engine, data_dir, database)
    server = start_live_server(own_engine, data_dir, max_in_flight=3)
    register_demo_adapters(server.state.adapters.registry, DEFAULT_DEMO_ADAPTERS_DIR, "demo")
    yield server
    server.stop()
    own_engine.adapters.close()
    database.dispose()


def _client(live, tenant: str = "demo", deployment: str | None = None, token: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.prefix(tenant, deployment) + "/v1",
                         api_key=token or live.tokens[tenant], max_retries=0, timeout=120)


def _tgi(live, inputs: str, **parameters) -> dict:
    response = httpx.post(live.prefix() + "/generate", headers=live.headers(), timeout=120,
                          json={"inputs": inputs, "parameters": {"details": True, **parameters}})
    assert response.status_code == 200, response.text
    return response.json()


def test_models_lists_the_base_model_and_the_tenants_adapters(live) -> None:
    models = {m.id: m for m in _client(live).models.list()}
    assert {live.model_name, "french/1", "json/1", "shout/1"} <= set(models)
    assert models["french/1"].owned_by == "demo"
    assert models["french/1"].model_extra["parent"] == live.model_name
    # The base model's files' time: the embedded model's conversion wrote its directory.
    assert models[live.model_name].created == int((ensure_embedded_model() / "config.json").stat().st_mtime) > 0
    assert {m.id for m in _client(live, "other").models.list()} == {live.model_name}


@pytest.mark.parametrize("model", [None, "french/1"], ids=["base", "adapter"])
def test_chat_equals_the_tgi_route_with_the_chat_template(live, model) -> None:
    completion = _client(live).chat.completions.create(
        model=model or live.model_name, messages=MESSAGES, temperature=0, max_tokens=12)
    expected = _tgi(live, json.dumps(MESSAGES), apply_chat_template=True, max_new_tokens=12,
                    **({"adapter_id": model} if model else {}))
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected["generated_text"]
    assert choice.finish_reason == {"length": "length", "eos_token": "stop"}[expected["details"]["finish_reason"]]
    assert completion.model == (model or live.model_name)
    assert completion.usage.prompt_tokens == expected["details"]["prompt_tokens"]
    assert completion.usage.completion_tokens == expected["details"]["generated_tokens"]
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


@pytest.mark.parametrize("model", [None, "shout/1"], ids=["base", "adapter"])
def test_completions_equal_the_tgi_route(live, model) -> None:
    completion = _client(live).completions.create(model=model or "", prompt=PROMPT, temperature=0, max_tokens=8)
    expected = _tgi(live, PROMPT, max_new_tokens=8, **({"adapter_id": model} if model else {}))
    assert completion.choices[0].text == expected["generated_text"]
    assert completion.object == "text_completion"
    assert completion.usage.completion_tokens == 8 and completion.choices[0].finish_reason == "length"


def test_chat_without_max_tokens_runs_to_eos(live) -> None:
    completion = _client(live).chat.completions.create(model=live.model_name, messages=MESSAGES[1:], temperature=0)
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens < live.state.engine_info.max_model_len


def test_streams_equal_the_whole_answers_and_report_usage(live) -> None:
    client = _client(live)
    whole = client.chat.completions.create(model="french/1", messages=MESSAGES, temperature=0, max_tokens=10)
    chunks = list(client.chat.completions.create(model="french/1", messages=MESSAGES, temperature=0,
                                                 max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    assert all(c.usage is None for c in chunks[:-1])

    streamed = list(client.completions.create(model="", prompt=PROMPT, temperature=0, max_tokens=6,
                                              stream=True, echo=True))
    plain = client.completions.create(model="", prompt=PROMPT, temperature=0, max_tokens=6)
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + plain.choices[0].text


def test_stop_sequences_end_the_text_without_being_part_of_it(live) -> None:
    client = _client(live)
    free = client.completions.create(model="", prompt=PROMPT, temperature=0, max_tokens=12).choices[0].text
    stop = free.strip().split()[1]  # the second word of the free answer
    cut = client.completions.create(model="", prompt=PROMPT, temperature=0, max_tokens=12, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[: free.index(stop)]
    streamed = client.completions.create(model="", prompt=PROMPT, temperature=0, max_tokens=12, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_chat_logprobs_are_the_tgi_logprobs_with_their_top_alternatives(live) -> None:
    completion = _client(live).chat.completions.create(
        model=live.model_name, messages=MESSAGES, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)
    expected = _tgi(live, json.dumps(MESSAGES), apply_chat_template=True, max_new_tokens=5)
    content = completion.choices[0].logprobs.content
    assert [t.token for t in content] == [t["text"] for t in expected["details"]["tokens"]]
    for entry, token in zip(content, expected["details"]["tokens"]):
        assert entry.logprob == pytest.approx(token["logprob"], abs=1e-4)
        assert len(entry.top_logprobs) == 3
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
        assert bytes(entry.bytes).decode() == entry.token


def test_completion_logprobs_with_echo_cover_the_prompt(live) -> None:
    completion = _client(live).completions.create(model="", prompt=PROMPT, temperature=0, max_tokens=3,
                                                  logprobs=2, echo=True)
    logprobs = completion.choices[0].logprobs
    expected = _tgi(live, PROMPT, max_new_tokens=3, decoder_input_details=True)
    num_prompt = len(expected["details"]["prefill"])
    assert logprobs.tokens == [t["text"] for t in expected["details"]["prefill"] + expected["details"]["tokens"]]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:num_prompt] == pytest.approx(
        [t["logprob"] for t in expected["details"]["prefill"][1:]], abs=1e-4)
    for token, top in zip(logprobs.tokens[num_prompt:], logprobs.top_logprobs[num_prompt:]):
        assert token in top and 2 <= len(top) <= 3
    assert completion.choices[0].text == PROMPT + expected["generated_text"]
    assert logprobs.text_offset[num_prompt] == len("".join(logprobs.tokens[:num_prompt]))


def test_json_schema_output_validates(live) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99_999_999}},
              "required": ["city", "population"], "additionalProperties": False}
    completion = _client(live).chat.completions.create(
        model=live.model_name, messages=MESSAGES, temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].message.content), schema)
    as_object = _client(live).chat.completions.create(
        model=live.model_name, messages=MESSAGES, temperature=0, max_tokens=60,
        response_format={"type": "json_object"})
    assert isinstance(json.loads(as_object.choices[0].message.content), dict)


def test_seed_makes_sampling_reproducible_and_n_gives_distinct_choices(live) -> None:
    client = _client(live)
    def sample(seed: int, **extra):
        return client.chat.completions.create(model="french/1", messages=MESSAGES, temperature=1.0,
                                              max_tokens=12, seed=seed, **extra)

    first, again, other = sample(7), sample(7), sample(8)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.choices[0].message.content != other.choices[0].message.content
    two = sample(7, n=2, logprobs=True)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content != two.choices[1].message.content
    assert two.usage.completion_tokens == sum(len(c.logprobs.content) for c in two.choices)
    # The choices come best first: OpenAI's `n` as the best of n candidates.
    means = [sum(t.logprob for t in c.logprobs.content) / len(c.logprobs.content) for c in two.choices]
    assert means[0] >= means[1]


def test_logit_bias_forces_a_token(live) -> None:
    token_id = live.state.engine_info.tokenizer.encode(" banana")[0]
    completion = _client(live).completions.create(model="", prompt=PROMPT, temperature=0, max_tokens=1,
                                                  logit_bias={str(token_id): 100})
    assert completion.choices[0].text == live.state.engine_info.tokenizer.decode([token_id])


def test_presence_and_frequency_penalties_change_the_greedy_answer(live) -> None:
    client = _client(live)
    prompt = "Repeat after me: la la la la la la la la"
    plain = client.completions.create(model="", prompt=prompt, temperature=0, max_tokens=10).choices[0].text
    penalised = client.completions.create(model="", prompt=prompt, temperature=0, max_tokens=10,
                                          frequency_penalty=2.0, presence_penalty=2.0).choices[0].text
    tokenizer = live.state.engine_info.tokenizer
    plain_ids, penalised_ids = tokenizer.encode(plain), tokenizer.encode(penalised)
    # An additive penalty per repeat: the penalised answer repeats its own tokens less.
    assert len(set(penalised_ids)) / len(penalised_ids) > len(set(plain_ids)) / len(plain_ids)


@pytest.mark.parametrize(("call", "exception", "param"), [
    (lambda c: c.chat.completions.create(model="", messages=MESSAGES, temperature=5), openai.BadRequestError,
     "temperature"),
    (lambda c: c.chat.completions.create(model="", messages=MESSAGES, max_tokens=10**7), openai.BadRequestError,
     "max_tokens"),
    (lambda c: c.chat.completions.create(model="", messages=MESSAGES, n=2, temperature=0), openai.BadRequestError,
     "n"),
    (lambda c: c.chat.completions.create(model="", messages=MESSAGES, tools=[
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}] * 2),
     openai.BadRequestError, "tools[1].function.name"),
    (lambda c: c.chat.completions.create(model="", messages=MESSAGES, top_logprobs=2), openai.BadRequestError,
     "top_logprobs"),
    (lambda c: c.chat.completions.create(model="", messages=[{"role": "tool", "content": "x"}]),
     openai.BadRequestError, "messages[0].tool_call_id"),
    (lambda c: c.chat.completions.create(model="", messages=[{"role": "critic", "content": "x"}]),
     openai.BadRequestError, "messages[0].role"),
    (lambda c: c.completions.create(model="", prompt=["a", ""]), openai.BadRequestError, "prompt[1]"),
    (lambda c: c.completions.create(model="", prompt="a", suffix="b"), openai.BadRequestError, "suffix"),
    (lambda c: c.completions.create(model="", prompt="a", logit_bias={"x": 1}), openai.BadRequestError,
     "logit_bias"),
    (lambda c: c.chat.completions.create(model="no-such/7", messages=MESSAGES), openai.NotFoundError, None),
])
def test_errors_raise_the_clients_typed_exceptions(live, call, exception, param) -> None:
    with pytest.raises(exception) as raised:
        call(_client(live))
    error = raised.value.body
    assert error["param"] == param and error["message"]
    if param:
        assert error["message"].startswith(param) and error["type"] == "invalid_request_error"


def test_auth_and_routing_errors_raise_the_clients_typed_exceptions(live) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(live, token="wrong").models.list()
    with pytest.raises(openai.PermissionDeniedError):
        _client(live, "other", deployment="demo-private").chat.completions.create(model="", messages=MESSAGES)
    with pytest.raises(openai.NotFoundError):
        _client(live, deployment="no-such-model").completions.create(model="", prompt=PROMPT)


def test_a_full_server_raises_rate_limit_with_retry_after(live) -> None:
    with server_full(live):
        with pytest.raises(openai.RateLimitError) as refused:
            _client(live).chat.completions.create(model="", messages=MESSAGES, max_tokens=2)
        assert refused.value.response.headers["Retry-After"]
        with pytest.raises(openai.RateLimitError):
            list(_client(live).chat.completions.create(model="", messages=MESSAGES, max_tokens=2, stream=True))


@pytest.mark.parametrize("fan_out", [{}, {"prompt": ["Count:", "List:"], "n": 2, "temperature": 1}],
                         ids=["one_request", "fanned_out"])
def test_a_stream_left_by_its_client_frees_the_engine(live, fan_out) -> None:
    disconnects = live.state.metrics.disconnects
    before = disconnects._value.get()
    stream = _client(live).completions.create(**{"model": "", "prompt": "Count:", "max_tokens": 1500, "stream": True,
                                                 "temperature": 0, **fan_out})
    next(iter(stream))
    stream.close()
    wait_until(lambda: engine_is_idle(live), 10)
    assert disconnects._value.get() == before + 1


def _adapter_requests(live) -> dict[tuple[str, str], float]:
    text = httpx.get(live.base_url + "/metrics", headers=live.headers(), timeout=30).text
    return {(s.labels["tenant"], s.labels["adapter"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "lora_adapter_requests_total"}


def test_openai_requests_count_in_the_same_metrics_as_the_tgi_routes(live) -> None:
    before = _adapter_requests(live)
    _client(live).chat.completions.create(model="shout/1", messages=MESSAGES, temperature=0, max_tokens=2)
    _tgi(live, PROMPT, max_new_tokens=2, adapter_id="shout/1")
    after = _adapter_requests(live)
    assert after[("demo", "shout/1")] == before.get(("demo", "shout/1"), 0) + 2


def test_cached_prompt_tokens_are_reported_in_usage_and_headers(live) -> None:
    system = {"role": "system", "content": "You answer questions about the tides of Brittany. " * 20}
    messages = [system, {"role": "user", "content": "When is high tide?"}]
    client = _client(live)
    first = client.chat.completions.create(model="french/1", messages=messages, temperature=0, max_tokens=3)
    second = client.chat.completions.with_raw_response.create(model="french/1", messages=messages,
                                                               temperature=0, max_tokens=3)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.parse().usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - 16 <= cached < first.usage.prompt_tokens
    assert second.headers["x-prompt-cached-tokens"] == str(cached)
    assert second.parse().choices[0].message.content == first.choices[0].message.content
    # Another adapter's request with the same messages finds nothing cached.
    other = client.chat.completions.create(model="shout/1", messages=messages, temperature=0, max_tokens=3)
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_a_replaced_pbase_version_never_reuses_the_old_kv(live, tmp_path) -> None:
    registry = live.state.adapters.registry
    messages = [{"role": "system", "content": "You describe the lighthouses of Finistere. " * 20},
                {"role": "user", "content": "Which is the tallest?"}]

    def register(demo_adapter: str) -> None:
        copy = tmp_path / demo_adapter  # the registry edits its input: a copy
        shutil.copytree(DEFAULT_DEMO_ADAPTERS_DIR / demo_adapter, copy, ignore=shutil.ignore_patterns("README*"))
        assert registry.create_version("demo", "demo", "swap", copy).tag == 1

    def ask():
        return _client(live).chat.completions.create(model="swap/1", messages=messages, temperature=0, max_tokens=4)

    register("french")
    ask()
    assert ask().usage.prompt_tokens_details.cached_tokens > 0
    registry.delete_repo("demo", "swap")
    register("shout")  # the same id, `swap/1`, now another blob
    replaced = ask()
    assert replaced.usage.prompt_tokens_details.cached_tokens == 0


def test_n_choices_stream_interleaved_by_index_each_as_its_seeds_single_choice(live) -> None:
    """Choice j of a streamed n draws with seed + j: the oracle is the whole n=1 answer with that seed."""
    client = _client(live)
    request = dict(model="", messages=MESSAGES, max_tokens=8, temperature=1)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    indices = []
    for chunk in client.chat.completions.create(stream=True, n=3, seed=7, **request):
        assert isinstance(chunk, openai.types.chat.ChatCompletionChunk)
        for choice in chunk.choices:
            indices.append(choice.index)
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert sorted(set(indices)) == [0, 1, 2] and indices != sorted(indices)  # interleaved
    for j in range(3):
        single = client.chat.completions.create(n=1, seed=7 + j, **request).choices[0]
        assert (texts[j], finishes[j]) == (single.message.content, single.finish_reason)


def test_a_list_of_prompts_gives_one_choice_per_prompt_and_n(live) -> None:
    client = _client(live)
    prompts = [PROMPT, "One, two, three,"]
    whole = client.completions.create(model="", prompt=prompts, n=2, seed=3, max_tokens=6, temperature=1)
    assert isinstance(whole, openai.types.Completion) and [c.index for c in whole.choices] == [0, 1, 2, 3]
    prompt_tokens = 0
    for p, prompt in enumerate(prompts):
        single = client.completions.create(model="", prompt=prompt, n=2, seed=3, max_tokens=6, temperature=1)
        assert [c.text for c in whole.choices[2 * p: 2 * p + 2]] == [c.text for c in single.choices]
        prompt_tokens += single.usage.prompt_tokens
    assert whole.usage.prompt_tokens == prompt_tokens
    streamed: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(model="", prompt=prompts, n=2, seed=3, max_tokens=6, temperature=1,
                                           stream=True, echo=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    # Streamed, choice j of a prompt draws with seed + j (the whole answer ranks its candidates).
    for p, prompt in enumerate(prompts):
        assert sorted(streamed[2 * p + j] for j in range(2)) == sorted(
            prompt + c.text for c in whole.choices[2 * p: 2 * p + 2])
    assert usage.prompt_tokens == prompt_tokens
