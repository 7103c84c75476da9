"""Constrained decoding on the embedded model: every schema output validates with jsonschema, every
regex output that ends with EOS is a `re.fullmatch`."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from lora_runtime.core import SamplingParams
from lora_runtime.errors import ValidationError
from lora_runtime.sampling import SamplingState, render_chat_prompt, schema_from_response_format
from tests.sampling.generation import generate

MAX_NEW_TOKENS = 40

SCHEMAS = {
    "object_with_bounds": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "array_of_bounded_numbers": {"type": "array", "items": {"type": "number", "minimum": -5, "maximum": 5},
                                 "minItems": 1, "maxItems": 3},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
             "additionalProperties": False},
    "nested": {
        "type": "object",
        "properties": {"user": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "active": {"type": "boolean"}},
            "required": ["id", "active"],
            "additionalProperties": False,
        }},
        "required": ["user"],
        "additionalProperties": False,
    },
    # multipleOf bounds the digits: a small model otherwise writes decimals until max_new_tokens.
    "bounded_number": {"type": "number", "minimum": 0.5, "maximum": 2.5, "multipleOf": 0.25},
}


def _prompt_ids(tokenizer, name: str) -> list[int]:
    # A short prompt keeps the batched prefill cheap on CPU; the grammar, not the prompt, makes it valid.
    text = render_chat_prompt(json.dumps([{"role": "user", "content": f"Reply in JSON: {name}"}]), tokenizer)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_every_output_validates_greedy_and_sampled(hf_model, tokenizer, tokenizer_info) -> None:
    """All schemas, greedy and sampled, decoded together in one batch."""
    names = sorted(SCHEMAS)
    cases = [(name, options) for options in ({}, {"do_sample": True, "seed": 11, "temperature": 1.2}) for name in names]
    prompts = [_prompt_ids(tokenizer, name) for name, _ in cases]
    states = [
        SamplingState(SamplingParams(max_new_tokens=MAX_NEW_TOKENS, schema=json.dumps(SCHEMAS[name]), **options),
                      prompt, tokenizer_info)
        for (name, options), prompt in zip(cases, prompts)
    ]
    outputs = generate(hf_model, prompts, states, {tokenizer.eos_token_id}, MAX_NEW_TOKENS)
    for (name, options), state, token_ids in zip(cases, states, outputs):
        assert token_ids[-1] == tokenizer.eos_token_id, f"{name} {options}: the document must end"
        assert state.is_grammar_complete
        jsonschema.validate(json.loads(tokenizer.decode(token_ids[:-1])), SCHEMAS[name])


@pytest.mark.parametrize(
    "schema",
    ['{"type": "array", "uniqueItems": true}', '{"not": {"type": "string"}}', '{"type": "strnig"}',
     "{not json", "[1, 2]", '{"$ref": "#/definitions/missing"}'],
)
def test_schemas_we_cannot_enforce_are_refused(schema: str, tokenizer_info) -> None:
    with pytest.raises(ValidationError) as error:
        tokenizer_info.schema_compiler.compile(schema)
    assert error.value.field == "schema" and error.value.error_type == "validation"


def test_schema_accepted_as_object_and_as_response_format(tokenizer_info) -> None:
    schema = SCHEMAS["enum"]
    compiler = tokenizer_info.schema_compiler
    assert compiler.compile(schema) == compiler.compile(json.dumps(schema))
    as_string = schema_from_response_format({"type": "json_schema", "schema": schema})
    assert json.loads(as_string) == schema
    openai_shape = {"type": "json_schema", "json_schema": {"name": "colour", "schema": schema}}
    assert json.loads(schema_from_response_format(openai_shape)) == schema
    assert json.loads(schema_from_response_format({"type": "json_object"})) == {"type": "object"}
    assert schema_from_response_format(None) is None
    with pytest.raises(ValidationError):
        schema_from_response_format({"type": "text"})


REGEXES = {
    "digits": r"\d{1,4}",
    "date": r"\d{4}-\d{2}-\d{2}",
    "words": r"(apple|banana|cherry)( and (apple|banana|cherry)){0,2}",
    "email": r"[a-z]{2,8}(\.[a-z]{2,8})?@[a-z]{2,8}\.(com|org|net)",
}


def test_every_regex_output_ending_with_eos_is_a_full_match(hf_model, tokenizer, tokenizer_info) -> None:
    """All regexes, greedy and with three seeds, decoded together in one batch."""
    options = [{}, *({"do_sample": True, "seed": seed, "temperature": 1.3} for seed in (1, 2, 3))]
    cases = [(name, option) for option in options for name in sorted(REGEXES)]
    prompts = [_prompt_ids(tokenizer, f"Write a {name}") for name, _ in cases]
    states = [
        SamplingState(SamplingParams(max_new_tokens=MAX_NEW_TOKENS, regex=REGEXES[name], **option), prompt,
                      tokenizer_info)
        for (name, option), prompt in zip(cases, prompts)
    ]
    outputs = generate(hf_model, prompts, states, {tokenizer.eos_token_id}, MAX_NEW_TOKENS)
    texts = set()
    for (name, option), state, token_ids in zip(cases, states, outputs):
        assert token_ids[-1] == tokenizer.eos_token_id, f"{name} {option}: the match must end"
        text = tokenizer.decode(token_ids[:-1])
        assert re.fullmatch(REGEXES[name], text), f"{name} {option}: {text!r}"
        texts.add(text)
    assert len(texts) > len(REGEXES), "seeded samples should differ from the greedy ones"


@pytest.mark.parametrize("regex", [r"(?=a)b", "[", "(a", "x{3,2}", r"\bword\b", r"(a)\1"])
def test_regexes_we_cannot_enforce_are_refused(regex: str, tokenizer_info) -> None:
    with pytest.raises(ValidationError) as error:
        tokenizer_info.schema_compiler.compile_regex(regex)
    assert error.value.field == "regex" and error.value.error_type == "validation"
    with pytest.raises(ValidationError) as error:
        SamplingState(SamplingParams(regex=regex), [1, 2], tokenizer_info)
    assert error.value.field == "regex"
