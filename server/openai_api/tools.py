"""OpenAI tool calling on the chat route: the request's `tools`, `tool_choice` and
`parallel_tool_calls` checked and turned into the engine's `ToolCalling` (which the engine makes a
grammar of, in the format of the chat template that renders the request:
`lora_runtime.sampling.tool_grammar`), and the history's tool calls and results into the chat
template's input (docs/api.md section 8).

Every tool's `parameters` must be a valid JSON schema (jsonschema's metaschema check) that
llguidance can enforce; each is checked on its own so that a refusal names the tool.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
import llguidance

from lora_runtime.api import JSON_COMPILE_OPTIONS, ToolCalling, ValidationError
from server.openai_api.protocol import ChatCompletionRequest

MAX_TOOLS = 128
# The engine compiles a request's grammar on its loop thread, between steps: this bounds each
# tool's share of that pause and names the tool that exceeds it (the whole grammar's bound:
# lora_runtime.sampling.tool_grammar.MAX_GRAMMAR_CHARS).
MAX_SCHEMA_CHARS = 16 * 1024
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one chat request does with tools: the tools for the prompt (OpenAI's shape) and what
    decoding does with them."""

    tools: tuple[dict[str, Any], ...]
    calling: ToolCalling
    tool_prompt: str | None = None  # TGI's: the text that introduces the tools


def tool_plan(body: ChatCompletionRequest, call_format: str) -> ToolPlan | None:
    """None when the request offers no tools; `call_format` is the operator's ("auto": the chat
    template's)."""
    if body.functions or body.function_call not in (None, "none", "auto"):
        raise ValidationError("functions" if body.functions else "function_call",
                              "the deprecated functions API is not supported: send tools")
    if not body.tools:
        if body.tool_choice not in (None, "none", "auto"):
            raise ValidationError("tool_choice", "needs tools")
        return None
    if body.response_format is not None and body.response_format.get("type") != "text":
        raise ValidationError("response_format", "cannot be combined with tools")
    schemas = _checked_tools(body.tools)
    callable_names, free_text_first = _choice(body.tool_choice, schemas)
    calling = ToolCalling(tuple(schemas.items()), callable_names, free_text_first,
                          parallel=body.parallel_tool_calls is not False, call_format=call_format)
    return ToolPlan(tuple(body.tools), calling, body.tool_prompt)


def _checked_tools(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """{name: arguments schema}, every tool checked."""
    if len(tools) > MAX_TOOLS:
        raise ValidationError("tools", f"at most {MAX_TOOLS} tools")
    schemas: dict[str, dict[str, Any]] = {}
    for index, tool in enumerate(tools):
        name, schema = _checked_tool(tool, f"tools[{index}]")
        if name in schemas:
            raise ValidationError(f"tools[{index}].function.name", f"duplicate tool name {name!r}")
        schemas[name] = schema
    return schemas


def _checked_tool(tool: Any, where: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ValidationError(where, "must be {\"type\": \"function\", \"function\": {...}}")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValidationError(f"{where}.function.name", "must be 1-64 letters, digits, '_' or '-'")
    schema = function.get("parameters", _EMPTY_PARAMETERS)
    _check_schema(schema, f"{where}.function.parameters", name)
    return name, schema


def _check_schema(schema: Any, where: str, name: str) -> None:
    """A JSON schema of an object that llguidance can enforce on its own."""
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise ValidationError(where, f"tool {name!r}: parameters must be a JSON schema of an object")
    if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise ValidationError(where, f"tool {name!r}: the schema is over {MAX_SCHEMA_CHARS} characters as JSON")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        raise ValidationError(where, f"tool {name!r}: not a valid JSON schema: {error.message}") from None
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_COMPILE_OPTIONS)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise ValidationError(where, f"tool {name!r}: cannot enforce its schema: {problem}")


def _choice(choice: str | dict[str, Any] | None, schemas: dict[str, Any]) -> tuple[tuple[str, ...], bool]:
    """(the names a reply may call, whether it may answer in text first). Besides OpenAI's shapes,
    TGI's: a tool's name as the string, and {"function": {"name": ...}} without "type"."""
    if choice in (None, "auto"):
        return tuple(schemas), True
    if choice == "none":
        return (), True
    if choice == "required":
        return tuple(schemas), False
    name = choice if isinstance(choice, str) else _named(choice)
    if name not in schemas:
        raise ValidationError("tool_choice", f"names {name!r}, which is not among tools")
    return (name,), False


def _named(choice: dict[str, Any]) -> str:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        raise ValidationError("tool_choice", "must be none, auto, required or "
                                             "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    return name


def template_tool_calls(calls: list[Any], where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as chat templates take them (arguments as objects)."""
    return [_template_call(call, f"{where}[{index}]") for index, call in enumerate(calls)]


def _template_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValidationError(where, "must be {\"id\", \"type\": \"function\", "
                                     "\"function\": {\"name\", \"arguments\"}}")
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except (TypeError, json.JSONDecodeError):
        raise ValidationError(f"{where}.function.arguments", "must be a JSON object as a string") from None
    if not isinstance(arguments, dict):
        raise ValidationError(f"{where}.function.arguments", "must be a JSON object as a string")
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}
