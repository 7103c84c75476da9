"""Tool calling on the OpenAI chat route, with the unmodified `openai` client (docs/api.md section 8).

Oracles: `jsonschema` for every returned call's arguments against its tool's schema; the chat
template as transformers renders it with `tools=`; llguidance's own matcher for what the grammar
accepts; the whole answer for the streamed fragments."""
from __future__ import annotations

import dataclasses
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import llguidance
import llguidance.hf
import openai
import pytest
import text_generation
import text_generation.types

from lora_runtime import Engine
from lora_runtime.config import AdapterConfig
from lora_runtime.sampling.chat import render_chat_prompt
from lora_runtime.core import ToolCalling
from lora_runtime.sampling.tool_grammar import tool_call_grammar
from lora_runtime.sampling.tools import TOOL_CALL_FORMATS, tool_call_format
from server.adapter_sources import engine_adapter_sources
from server.config import DEFAULT_DEMO_ADAPTERS_DIR, TOOL_CALL_FORMAT_CHOICES, ServerConfig
from server.db import open_database
from server.openai_api.tool_calls import parse_reply
from tests.adapters.demo_behaviour import HELD_OUT_QUESTIONS
from tests.server.live import start_live_server
from tests.wiring.conftest import make_embedded_adapter

pytestmark = pytest.mark.xdist_group("test_openai_tools")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
RANDOM = "random"  # the random adapter's name in the local adapter directory
HERMES = TOOL_CALL_FORMATS["hermes"]


@pytest.fixture(scope="module")
def live(engine, tmp_path_factory):
    """A server with a random adapter in its local adapter directory."""
    root = tmp_path_factory.mktemp("openai-tools")
    make_embedded_adapter(root / "local" / RANDOM, seed=46)
    shutil.copytree(DEFAULT_DEMO_ADAPTERS_DIR / "tools", root / "local" / "tools",
                    ignore=shutil.ignore_patterns("README*"))
    data_dir = root / "data"
    data_dir.mkdir()
    database = open_database(f"sqlite:///{data_dir / 'state.db'}")
    sources = engine_adapter_sources(ServerConfig(data_dir=data_dir, adapter_dir=root / "local"), database)
    config = dataclasses.replace(engine.config, adapters=AdapterConfig(allow_local_paths=False))
    own_engine = Engine(config, engine.model, engine.tokenizer, engine.model_name, sources)
    server = start_live_server(own_engine, data_dir, adapter_dir=root / "local")
    yield server
    server.stop()
    own_engine.adapters.close()
    database.dispose()


def _client(live, timeout_s: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.prefix() + "/v1", api_key=live.tokens["demo"], max_retries=0,
                         timeout=timeout_s)


def _model(live, adapter: bool | str) -> dict:
    if adapter:
        return {"model": RANDOM if adapter is True else adapter, "extra_body": {"adapter_source": "local"}}
    return {"model": live.model_name}


def _checked_calls(choice) -> list:
    """The choice's calls, every one parsed and valid against its tool's schema."""
    calls = choice.message.tool_calls or []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def test_required_and_named_calls_are_valid_for_base_and_adapter_in_one_batch(live) -> None:
    """Dozens of calls sampled at temperature 1, base model and a random adapter at once: none malformed."""
    named = {"type": "function", "function": {"name": "get_time"}}
    jobs = [(adapter, choice) for adapter in (False, True) for choice in ("required", named)]

    def ask(job):
        adapter, choice = job
        return choice, _client(live).chat.completions.create(
            messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, n=3,
            max_tokens=64, temperature=1, **_model(live, adapter))

    answers = _concurrently(*[lambda job=job: ask(job) for job in jobs])
    num_calls = 0
    for choice, completion in answers:
        for returned in completion.choices:
            calls = _checked_calls(returned)
            assert returned.finish_reason == "tool_calls", returned
            assert len(calls) == 1 and returned.message.content is None
            if choice != "required":
                assert calls[0].function.name == "get_time"
            num_calls += 1
    assert num_calls == len(jobs) * 3


QUESTIONS = ["What is the weather in Paris?", "What time is it in Oslo?", "Is it raining in Lima?",
             "Tell me the time in Tokyo and the weather there."]


def test_hundreds_of_sampled_calls_across_base_tools_and_random_adapters_are_all_well_formed(live) -> None:
    """The proof: 204 calls drawn at temperature 1 (51 requests of n=4, all at once: mixed batches
    of the base model, the `tools` demo adapter and a random adapter; required and named tool
    choices; half with stop sequences that occur in every call): every one parses and its
    arguments validate, none cut."""
    named = [{"type": "function", "function": {"name": name}} for name in SCHEMAS]
    jobs = [(adapter, ["required", *named][index % 3], QUESTIONS[index % 4], ['"', "}"] if index % 2 else None)
            for adapter in (False, True, "tools") for index in range(17)]

    def ask(job):
        adapter, choice, question, stop = job
        # All 51 wait on one engine: on a busy CPU the last answers after minutes.
        return choice, _client(live, timeout_s=900).chat.completions.create(
            messages=[{"role": "user", "content": question}], tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, n=4, max_tokens=64, temperature=1, stop=stop, **_model(live, adapter))

    answers = _concurrently(*[lambda job=job: ask(job) for job in jobs])
    num_calls = 0
    for choice, completion in answers:
        for returned in completion.choices:
            assert returned.finish_reason == "tool_calls", returned
            (call,) = _checked_calls(returned)
            assert choice == "required" or call.function.name == choice["function"]["name"]
            num_calls += 1
    assert num_calls == len(jobs) * 4 == 204


def _concurrently(*calls):
    """The calls' results, the calls made at once (one engine batch, and less waiting)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def _streamed(stream) -> tuple[list[tuple[str, str]], list[str], str | None]:
    """((name, arguments) per call, ids, finish reason) from a stream's fragments."""
    fragments: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content
        for call in delta.tool_calls or []:
            entry = fragments.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [(f["name"], f["arguments"]) for f in fragments.values()], [f["id"] for f in fragments.values()], finish


def test_streamed_fragments_concatenate_to_the_whole_answers_calls(live) -> None:
    def request(adapter: bool) -> dict:
        return dict(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                    max_tokens=64, temperature=0, **_model(live, adapter))

    client = _client(live)
    answers = _concurrently(*[lambda adapter=adapter: client.chat.completions.create(**request(adapter))
                              for adapter in (False, True)],
                            *[lambda adapter=adapter: _streamed(client.chat.completions.create(stream=True,
                                                                                               **request(adapter)))
                              for adapter in (False, True)])
    for whole, (calls, ids, finish) in zip(answers[:2], answers[2:]):
        choice = whole.choices[0]
        assert calls == [(c.function.name, c.function.arguments) for c in _checked_calls(choice)]
        assert all(call_id.startswith("call_") for call_id in ids)
        assert finish == choice.finish_reason == "tool_calls"


def test_parallel_calls_each_validate(live) -> None:
    completion = _client(live).chat.completions.create(
        messages=ASK, tools=TOOLS, tool_choice="required", n=3, max_tokens=80, temperature=1,
        **_model(live, adapter=False))
    for choice in completion.choices:
        calls = choice.message.tool_calls
        complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]  # max_tokens may cut the last
        for call in complete:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({call.id for choice in completion.choices for call in choice.message.tool_calls}) == \
        sum(len(choice.message.tool_calls) for choice in completion.choices)


def test_auto_and_none_leave_text_free(live) -> None:
    client = _client(live)
    completions = _concurrently(*[lambda choice=choice: client.chat.completions.create(
        messages=ASK, tools=TOOLS, tool_choice=choice, n=3, max_tokens=24, temperature=1,
        **_model(live, adapter=True)) for choice in ("auto", "none")])
    for choice, completion in zip(("auto", "none"), completions):
        for returned in completion.choices:
            calls = _checked_calls(returned)
            if choice == "none":
                assert not calls and returned.finish_reason in ("stop", "length")
            if not calls:
                assert isinstance(returned.message.content, str)


def test_a_tool_result_in_the_history_is_rendered_and_answered(live) -> None:
    first = _client(live).chat.completions.create(
        messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40, temperature=0, **_model(live, adapter=False)).choices[0]
    call = _checked_calls(first)[0]
    history = [*ASK, first.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = _client(live).chat.completions.create(
        messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0,
        **_model(live, adapter=False), logprobs=True)
    assert second.choices[0].message.content
    # The prompt is the history as this server renders it for a template that does not know tools:
    # the tools in the system message, the call in the format, the result as a user turn.
    tokenizer = live.state.engine_info.tokenizer
    arguments = json.loads(call.function.arguments)
    inputs = json.dumps({"messages": [
        *ASK, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": call.id}], "tools": TOOLS})
    prompt = render_chat_prompt(inputs, tokenizer)
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}\n</tool_call>' in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>' in prompt
    assert second.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def test_a_template_that_knows_tools_renders_them_itself(live) -> None:
    """transformers' `apply_chat_template(tools=...)` is the oracle."""
    tokenizer = live.state.engine_info.tokenizer
    template = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
                "{% endfor %}\n{% endfor %}")
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]}]
    prompt = render_chat_prompt(json.dumps({"messages": messages, "tools": TOOLS}), tokenizer, template)
    assert prompt == tokenizer.apply_chat_template(messages, tools=TOOLS, chat_template=template, tokenize=False,
                                                   add_generation_prompt=True)
    assert "TOOL get_weather\nTOOL get_time\n" in prompt and 'CALL get_time {"zone": "CET"}' in prompt


@pytest.mark.parametrize(("tools", "choice", "param"), [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}],
     "auto", "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "uniqueItems": True,
                                                                    "properties": {"a": {"type": "array",
                                                                                         "uniqueItems": True}}}}}],
     "auto", "tools[0].function.parameters"),
    (TOOLS + TOOLS[:1], "auto", "tools[2].function.name"),
    ([{"type": "function", "function": {"name": "big", "parameters": {
        "type": "object", "properties": {f"p{i:05}": {"type": "integer"} for i in range(1000)}}}}],
     "auto", "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": f"t{n}", "parameters": {
        "type": "object", "properties": {f"p{i:04}": {"type": "integer"} for i in range(300)}}}} for n in range(10)],
     "required", "tools"),
    ([{"type": "function", "function": {"name": "bad name"}}], "auto", "tools[0].function.name"),
    (TOOLS, {"type": "function", "function": {"name": "get_news"}}, "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_are_400_naming_the_field(live, tools, choice, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _client(live).chat.completions.create(messages=ASK, tools=tools, tool_choice=choice, max_tokens=4,
                                              **_model(live, adapter=False))
    error = refused.value.body
    assert error["param"] == param and error["message"].startswith(param)
    assert error["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def matcher_tokenizer(engine):
    return llguidance.hf.from_tokenizer(engine.tokenizer, n_vocab=engine.model.shape.vocab_size)


def _accepts(grammar: str, text: str, tokenizer, engine) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(matcher.consume_token(token) for token in ids) and matcher.is_accepting()


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS.values(), ids=list(TOOL_CALL_FORMATS))
def test_the_grammar_takes_text_then_calls_and_nothing_malformed(engine, matcher_tokenizer, fmt) -> None:
    request = ToolCalling((("get_weather", WEATHER), ("get_time", TIME)), ("get_weather", "get_time"),
                          free_text_first=True, parallel=True)
    grammar = tool_call_grammar(request, fmt)
    two = fmt.render_calls([("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"zone": "CET"}')])
    for text, accepted in [("Just text.", True), ("Let me look. " + two, True),
                           (fmt.render_calls([("get_time", '{"zone": "cet"}')]), False),
                           (fmt.render_calls([("get_news", "{}")]), False),
                           (fmt.trigger + " not a call", False)]:
        assert _accepts(grammar, text, matcher_tokenizer, engine) is accepted, text
    single = tool_call_grammar(ToolCalling(request.tools, ("get_time",), False, False), fmt)
    assert _accepts(single, fmt.render_calls([("get_time", '{"zone": "CET"}')]), matcher_tokenizer, engine)
    assert not _accepts(single, two, matcher_tokenizer, engine)
    assert not _accepts(single, "text " + fmt.render_calls([("get_time", '{"zone": "CET"}')]),
                        matcher_tokenizer, engine)


def test_the_reader_gives_content_and_calls_and_holds_back_a_trigger_prefix() -> None:
    text = "Sure. " + HERMES.render_calls([("get_time", '{"zone": "CET"}'), ("get_weather", '{"city": "Oslo"}')])
    reply = parse_reply(text[: text.index('"Oslo"') + len('"Oslo"')], HERMES)
    assert reply.content == "Sure. "
    assert [(c.name, c.arguments, c.complete) for c in reply.calls] == [
        ("get_time", '{"zone": "CET"}', True), ("get_weather", '{"city": "Oslo"', False)]
    assert parse_reply("Sure. <tool_", HERMES).held == len("<tool_")


def test_the_clis_format_choices_are_the_engines_formats() -> None:
    assert TOOL_CALL_FORMAT_CHOICES == ("auto", *TOOL_CALL_FORMATS)


def test_tgis_client_gets_a_named_call_and_tool_prompt_introduces_the_tools(live) -> None:
    """text-generation 0.7.0's `chat` (model "tgi", tool_choice a tool's name, a required
    system_fingerprint) on the same route."""
    client = text_generation.Client(live.prefix(), headers=live.headers(), timeout=120)
    answer = client.chat(messages=[text_generation.types.Message(**ASK[0])], max_tokens=64, temperature=0.5,
                         tools=[text_generation.types.Tool(**tool) for tool in TOOLS], tool_choice="get_time")
    call = answer.choices[0].message.tool_calls[0]
    # TGI's client sends no parallel_tool_calls (OpenAI's default: true): more calls may follow.
    assert answer.choices[0].finish_reason in ("tool_calls", "length") and call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TIME)
    inputs = {"messages": ASK, "tools": TOOLS, "tool_prompt": "Pick a tool."}
    prompt = render_chat_prompt(json.dumps(inputs), live.state.engine_info.tokenizer)
    assert prompt.startswith("<|im_start|>system\nPick a tool.\n" + json.dumps(TOOLS[0], sort_keys=True))


def test_tgis_client_streams_tool_calls_and_text_in_tgis_shape(live) -> None:
    """text-generation 0.7.0's `chat(stream=True)` parses every chunk with its own types (a role in
    every delta, `tool_calls` one object, no `[DONE]`): the streamed fragments concatenate to the
    whole answer's call; a stream without tools gives the whole answer's text. lorax-client 0.6.3 has
    no chat method."""
    client = text_generation.Client(live.prefix(), headers=live.headers(), timeout=120)
    message = [text_generation.types.Message(**ASK[0])]
    tools = [text_generation.types.Tool(**tool) for tool in TOOLS]
    whole = client.chat(messages=message, max_tokens=64, temperature=0, tools=tools, tool_choice="get_weather")
    chunks = list(client.chat(messages=message, max_tokens=64, temperature=0, tools=tools, tool_choice="get_weather",
                              stream=True))
    assert all(chunk.choices[0].delta.role == "assistant" for chunk in chunks)
    fragments = [chunk.choices[0].delta.tool_calls for chunk in chunks if chunk.choices[0].delta.tool_calls]
    streamed_calls: dict[int, list[str]] = {}
    for fragment in fragments:  # TGI's client sends no parallel_tool_calls: more calls may follow
        is_first = fragment.index not in streamed_calls
        assert fragment.id.startswith("call_") if is_first else fragment.id == "" and fragment.function.name is None
        streamed_calls.setdefault(fragment.index, [fragment.function.name or ""]).append(fragment.function.arguments)
    expected = [[call["function"]["name"], call["function"]["arguments"]] for call in whole.choices[0].message.tool_calls]
    assert [[name, "".join(arguments)] for name, *arguments in streamed_calls.values()] == expected
    assert expected[0][0] == "get_weather"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    plain = client.chat(messages=message, max_tokens=8, temperature=0)
    streamed = client.chat(messages=message, max_tokens=8, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == plain.choices[0].message.content


def test_the_format_comes_from_the_template_unless_the_operator_names_one() -> None:
    assert tool_call_format("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert tool_call_format("{{ messages }}").name == "hermes"
    assert tool_call_format("{{ '[TOOL_CALLS]' }}", "hermes").name == "hermes"
    assert tool_call_format("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert tool_call_format("{{ '<|start_header_id|>ipython<|end_header_id|>' }}").name == "llama3_json"
    assert tool_call_format("{{ '<tool_call>' }} ipython").name == "hermes"


def test_the_tools_demo_adapter_calls_the_weather_tool_when_asked_about_weather_and_answers_otherwise(live) -> None:
    """Held-out questions (cities not in its training data), the tool offered, tool_choice auto."""
    weather_tool = [{"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False}}}]
    weather = ["What is the weather in Kyoto?", "Is it snowing in Helsinki?"]
    client = _client(live)
    answers = _concurrently(*[lambda q=q: client.chat.completions.create(
        messages=[{"role": "user", "content": q}], tools=weather_tool, max_tokens=40, temperature=0,
        **_model(live, "tools")).choices[0] for q in [*weather, *HELD_OUT_QUESTIONS[:2]]])
    for answer in answers[:2]:
        assert answer.finish_reason == "tool_calls", answer
        (call,) = answer.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), weather_tool[0]["function"]["parameters"])
    for answer in answers[2:]:
        assert not answer.message.tool_calls and answer.message.content, answer
