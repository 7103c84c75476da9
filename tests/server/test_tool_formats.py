"""Tool-call formats chosen per request from the chat template that renders it, on a tiny random
Llama whose tokenizer has Llama 3.x's special tokens and tool-style template, with an adapter that
carries its own Hermes-style template (`tests.fixtures.tool_models`, built locally).

Oracles: transformers' `apply_chat_template(tools=...)` for the prompts, `jsonschema` for every
call's arguments, llguidance's own matcher for what the grammar accepts, the tokenizer's ids for the
special tokens the replies hold."""
from __future__ import annotations

import dataclasses
import json

import jsonschema
import llguidance
import llguidance.hf
import openai
import pytest

from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.config import AdapterConfig
from lora_runtime.core import ToolCalling
from lora_runtime.sampling.stop import StopCriteria
from lora_runtime.sampling.tool_grammar import special_marker_ids, tool_call_grammar
from lora_runtime.sampling.tools import TOOL_CALL_FORMATS
from server.adapter_sources import engine_adapter_sources
from server.config import ServerConfig
from server.db import open_database
from server.openai_api.tool_calls import parse_reply
from tests.server.live import start_live_server
from tests.fixtures.tool_models import (
    HERMES_STYLE_TEMPLATE,
    save_hermes_template_adapter,
    save_llama3_tool_model,
)
from tests.server.test_openai_tools import SCHEMAS, TOOLS

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
INPUTS = json.dumps({"messages": ASK, "tools": TOOLS})
ALL_TOOLS = tuple(SCHEMAS.items())


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """(engine, adapter directory): the Llama 3.x-style model and its Hermes-template adapter."""
    root = tmp_path_factory.mktemp("tool-formats")
    base = save_llama3_tool_model(root / "model")
    adapter_dir = save_hermes_template_adapter(base, root / "hermes-adapter")
    return Engine.from_config(EngineConfig(model=str(root / "model"), dtype="float32")), adapter_dir


def test_the_openai_route_answers_each_request_in_its_templates_format(tool_model, tmp_path) -> None:
    """Through the unmodified `openai` client, at once: the base model (Llama 3.x template) and the
    adapter with its own Hermes template, streamed and whole; each answer's calls read back in its
    own format, the streamed fragments equal to the whole answer's."""
    shared, adapter_dir = tool_model
    database = open_database(f"sqlite:///{tmp_path / 'sources.db'}")
    sources = engine_adapter_sources(ServerConfig(data_dir=tmp_path, adapter_dir=adapter_dir.parent), database)
    engine = Engine(dataclasses.replace(shared.config, adapters=AdapterConfig(allow_local_paths=False)),
                    shared.model, shared.tokenizer, shared.model_name, sources)
    server = start_live_server(engine, tmp_path, adapter_dir=adapter_dir.parent)
    try:
        client = openai.OpenAI(base_url=server.prefix() + "/v1", api_key=server.tokens["demo"], max_retries=0,
                               timeout=300)
        for model in [{"model": server.model_name}, {"model": adapter_dir.name, "extra_body": {"adapter_source": "local"}}]:
            request = dict(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                           max_tokens=64, temperature=0, **model)
            whole = client.chat.completions.create(**request).choices[0]
            assert whole.finish_reason == "tool_calls"
            (call,) = whole.message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            fragments = [delta.function for chunk in client.chat.completions.create(stream=True, **request)
                         for delta in chunk.choices[0].delta.tool_calls or []]
            assert fragments[0].name == call.function.name
            assert "".join(fragment.arguments or "" for fragment in fragments) == call.function.arguments
    finally:
        server.stop()
        engine.adapters.close()
        database.dispose()


def _calling(choice: str = "required", parallel: bool = False) -> ToolCalling:
    names = ("get_time",) if choice == "get_time" else tuple(SCHEMAS)
    return ToolCalling(ALL_TOOLS, names, free_text_first=choice == "auto", parallel=parallel)


def _params(calling: ToolCalling, **overrides) -> SamplingParams:
    values = dict(max_new_tokens=64, do_sample=True, seed=11, apply_chat_template=True, tool_calling=calling)
    return SamplingParams(**{**values, **overrides})


def _valid_calls(output) -> list:
    """The reply's calls, read back in its format; every one complete and valid under its schema."""
    assert output.error is None and output.finish_reason == "eos_token", output
    reply = parse_reply(output.text, TOOL_CALL_FORMATS[output.tool_call_format])
    assert reply.calls and reply.content == ""
    for call in reply.calls:
        assert call.complete
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return list(reply.calls)


def _token_id(engine, token: str) -> int:
    return engine.tokenizer.convert_tokens_to_ids(token)


def test_the_llama3_template_gets_llama3_json_calls(tool_model) -> None:
    """Required, named and (opened by the `<|python_tag|>` token, which a bias makes the model
    write) auto: Llama 3.x's JSON calls, valid, the special token kept in the text."""
    engine, _ = tool_model
    python_tag = _token_id(engine, "<|python_tag|>")
    params = [_params(_calling("required")), _params(_calling("get_time"), seed=12),
              _params(_calling("auto"), seed=13, logit_bias=((python_tag, 100.0),))]
    outputs = engine.generate([INPUTS] * 3, params)
    assert outputs[0].prompt == engine.tokenizer.apply_chat_template(ASK, tools=TOOLS, tokenize=False,
                                                                     add_generation_prompt=True)
    for output in outputs:
        assert output.tool_call_format == "llama3_json"
        _valid_calls(output)
    assert _valid_calls(outputs[1])[0].name == "get_time"
    assert outputs[2].token_ids[0] == python_tag and outputs[2].text.startswith("<|python_tag|>{\"name\": ")
    assert python_tag not in outputs[0].token_ids[1:]


def test_an_adapters_own_template_gets_its_own_format_in_a_mixed_batch(tool_model) -> None:
    """The same request to the base model and to an adapter whose directory carries a Hermes
    template: Llama 3.x calls from one, Hermes calls from the other, in one batch; each reply opens
    with its own format's special token (both are biased up; the grammar lets only its own in)."""
    engine, adapter_dir = tool_model
    markers = [_token_id(engine, token) for token in ("<|python_tag|>", "<tool_call>", "</tool_call>")]
    params = _params(_calling("auto"), logit_bias=tuple((token, 100.0) for token in markers))
    adapters = [None, str(adapter_dir), None, str(adapter_dir)]
    outputs = engine.generate([INPUTS] * 4, [dataclasses.replace(params, seed=seed) for seed in range(4)], adapters)
    for output, adapter in zip(outputs, adapters):
        _valid_calls(output)
        if adapter is None:
            assert output.tool_call_format == "llama3_json" and output.token_ids[0] == markers[0]
            continue
        assert output.tool_call_format == "hermes"
        assert output.token_ids[0] == markers[1] and markers[2] in output.token_ids
        assert output.prompt == engine.tokenizer.apply_chat_template(ASK, tools=TOOLS, tokenize=False,
                                                                     add_generation_prompt=True,
                                                                     chat_template=HERMES_STYLE_TEMPLATE)


def test_the_grammar_takes_a_special_token_marker_as_that_token_or_as_its_text(tool_model) -> None:
    engine, _ = tool_model
    tokenizer = engine.tokenizer
    matcher_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=engine.model.shape.vocab_size)
    hermes = TOOL_CALL_FORMATS["hermes"]
    special_ids = special_marker_ids(tokenizer, hermes)
    assert set(special_ids) == {"<tool_call>", "</tool_call>"}
    grammar = tool_call_grammar(_calling("auto", parallel=True), hermes, special_ids)
    call = '\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
    text = lambda piece: tokenizer(piece, add_special_tokens=False)["input_ids"]  # noqa: E731
    # The tokenizer writes a marker's text as its special token; its pieces, encoded apart, spell it.
    opening, closing = [special_ids["<tool_call>"]], [special_ids["</tool_call>"]]
    opening_text, closing_text = text("<tool") + text("_call>"), text("</tool") + text("_call>")
    assert opening_text != opening and tokenizer.decode(opening_text) == "<tool_call>"
    for ids, accepted in [(text("Let me see. ") + opening + text(call) + closing, True),
                          (text("Let me see. ") + opening_text + text(call) + closing_text, True),
                          (opening + text(call) + closing_text, True), (text("Just text."), True),
                          (text("Hi ") + opening + text(" no call"), False)]:
        matcher = llguidance.LLMatcher(matcher_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        assert (all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()) is accepted, ids


@pytest.mark.parametrize("fmt", ["llama3_json", "hermes"])
def test_stop_sequences_never_cut_a_call(tool_model, fmt) -> None:
    """Stops that occur in every call (its quotes, braces, colons, newlines): the calls come out
    whole and valid, ended by EOS, under required and, once the free text has led to a call, under
    auto."""
    engine, adapter_dir = tool_model
    adapter = None if fmt == "llama3_json" else str(adapter_dir)
    marker = _token_id(engine, "<|python_tag|>" if adapter is None else "<tool_call>")
    stops = ('"', "}", ": ", "\n")
    params = [_params(_calling("required"), stop=stops, seed=21),
              _params(_calling("auto"), stop=stops, seed=22, logit_bias=((marker, 100.0),))]
    for output in engine.generate([INPUTS] * 2, params, [adapter] * 2):
        assert output.tool_call_format == fmt
        _valid_calls(output)


def test_stops_apply_to_the_free_text_before_the_calls() -> None:
    """The free text is checked for stops, the calls and a tail that may begin the trigger are not."""
    calling = ToolCalling(ALL_TOOLS, tuple(SCHEMAS), free_text_first=True, parallel=False, call_format="hermes")
    pieces = ["Sure", "} <tool", "_call>\n", '{"name"', "}"]
    criteria = StopCriteria(SamplingParams(stop=("}",), tool_calling=calling), eos_token_ids=[0])
    assert [criteria.check(5, piece) for piece in pieces] == [None, "stop_sequence", None, None, None]
    criteria = StopCriteria(SamplingParams(stop=("<tool", "name"), tool_calling=calling), eos_token_ids=[0])
    assert [criteria.check(5, piece) for piece in pieces] == [None] * 5
    criteria = StopCriteria(SamplingParams(stop=("<tool",), tool_calling=calling), eos_token_ids=[0])
    assert [criteria.check(5, piece) for piece in ["Hi <tool", "box>"]] == [None, "stop_sequence"]
    llama = ToolCalling(ALL_TOOLS, tuple(SCHEMAS), free_text_first=True, parallel=False, call_format="llama3_json")
    for text, hit in [('{"name": "a"}', None), ("A {text}", "stop_sequence")]:
        criteria = StopCriteria(SamplingParams(stop=("}",), tool_calling=llama), eos_token_ids=[0])
        assert [criteria.check(5, char) for char in text][-1] == hit


def test_the_reader_takes_llama3_calls_only_where_they_open_the_reply() -> None:
    llama = TOOL_CALL_FORMATS["llama3_json"]
    text = llama.render_calls([("get_time", '{"zone": "CET"}'), ("get_weather", '{"city": "Oslo"}')])
    assert text == '{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    reply = parse_reply("<|python_tag|>" + text[:-2], llama)
    assert reply.content == "" and [(c.name, c.arguments, c.complete) for c in reply.calls] == [
        ("get_time", '{"zone": "CET"}', True), ("get_weather", '{"city": "Oslo"', False)]
    assert parse_reply("<|pyth", llama).held == len("<|pyth")
    free = parse_reply("Sure: " + text, llama)
    assert free.calls == () and free.content == "Sure: " + text and free.held == 0
