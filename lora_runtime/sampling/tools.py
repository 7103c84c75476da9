"""Tool calls: the text format a model writes them in, the llguidance grammar that makes every call
well formed, and the prompt that offers the tools when the chat template cannot.

A format is a family's own markup around a list of calls, each `{"name": N, "arguments": A}` with
compact separators: Hermes / Qwen `<tool_call>\\n{...}\\n</tool_call>` (one block per call), Mistral
`[TOOL_CALLS][{...}, {...}]`. It is picked from the chat template (a template that writes
`[TOOL_CALLS]` is Mistral's) or by the operator; Hermes otherwise, since it is what most open models
fine-tuned for tools write.

The grammar constrains from the first token (`required`, a named tool), or under `auto` leaves the
text free until the format's trigger appears (a lazy lexeme: llguidance ends the free text at the
first trigger), then forces the calls. Each call's arguments follow that tool's JSON schema
(llguidance's `%json`), with the same compact separators as `response_format`.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lora_runtime.errors import ValidationError
from lora_runtime.sampling.schema import JSON_COMPILE_OPTIONS


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """`begin` call (`separator` call)* `end`; `trigger` (a prefix of `begin`) marks a call's start
    in free text. Tool results go back to a template that does not know tools between
    `result_open` and `result_close`, as a user turn."""

    name: str
    trigger: str
    begin: str
    separator: str
    end: str
    result_open: str
    result_close: str
    arguments_key: str = "arguments"

    def call_head(self, name: str) -> str:
        """The literal text of a call before its arguments."""
        return f'{{"name": {json.dumps(name)}, "{self.arguments_key}": '

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        """(name, arguments JSON) pairs as this format writes them."""
        bodies = [self.call_head(name) + arguments + "}" for name, arguments in calls]
        return self.begin + self.separator.join(bodies) + self.end


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat("hermes", "<tool_call>", "<tool_call>\n", "\n</tool_call>\n<tool_call>\n",
                             "\n</tool_call>", "<tool_response>\n", "\n</tool_response>"),
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS]", "[TOOL_CALLS][", ", ", "]",
                              "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
}


def tool_call_format(chat_template: str | None, configured: str = "auto") -> ToolCallFormat:
    """The operator's format, or under "auto" the one the chat template writes (Hermes by default)."""
    if configured != "auto":
        return TOOL_CALL_FORMATS[configured]
    if chat_template and "[TOOL_CALLS]" in chat_template:
        return TOOL_CALL_FORMATS["mistral"]
    return TOOL_CALL_FORMATS["hermes"]


def template_knows_tools(chat_template: str) -> bool:
    """The template renders `tools` itself (transformers passes them as the `tools` variable)."""
    return "tools" in chat_template


@dataclass(frozen=True, slots=True)
class ToolGrammarRequest:
    """What the grammar needs: each offered tool's (name, arguments schema), which of them may be
    called (all, or the one tool_choice names), whether the text may stay free (`auto`), and
    whether several calls may follow one another."""

    tools: tuple[tuple[str, Mapping[str, Any]], ...]
    callable_names: tuple[str, ...]
    free_text_first: bool
    parallel: bool


def tool_call_grammar(request: ToolGrammarRequest, fmt: ToolCallFormat) -> str:
    """The Lark grammar (llguidance's dialect) of a reply under `request`."""
    schemas = dict(request.tools)
    alternatives = " | ".join(f"call_{index}" for index in range(len(request.callable_names)))
    calls = "call (SEPARATOR call)*" if request.parallel else "call"
    lines = ["%llguidance {}"]
    if request.free_text_first:
        rest = fmt.begin[len(fmt.trigger):]
        lines += [f"start: TEXT | trigger {_literal(rest)} calls {_literal(fmt.end)}",
                  f"trigger[lazy]: TEXT {_literal(fmt.trigger)}",
                  r"TEXT: /(.|\n)*/"]
    else:
        lines.append(f"start: {_literal(fmt.begin)} calls {_literal(fmt.end)}")
    lines += [f"calls: {calls}", f"call: {alternatives}", f"SEPARATOR: {_literal(fmt.separator)}"]
    for index, name in enumerate(request.callable_names):
        schema = json.dumps(_compact(schemas[name]))
        lines.append(f"call_{index}: {_literal(fmt.call_head(name))} %json {schema} \"}}\"")
    return "\n".join(lines) + "\n"


def _literal(text: str) -> str:
    # Lark's string literals take JSON's escapes.
    return json.dumps(text)


def _compact(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The schema with the compact separators, unless it sets its own llguidance options."""
    options = {**JSON_COMPILE_OPTIONS, **schema.get("x-guidance", {})}
    return {**schema, "x-guidance": options}


_DEFAULT_TOOL_PROMPT = "You can call the following functions (JSON schemas, one per line):"


def tools_system_prompt(tools: Sequence[Mapping[str, Any]], fmt: ToolCallFormat, intro: str | None = None) -> str:
    """How this server offers tools to a model whose chat template does not render them; `intro`
    (TGI's `tool_prompt`) replaces the first line."""
    listing = "\n".join(json.dumps(tool, sort_keys=True) for tool in tools)
    example = fmt.render_calls([("<function name>", "<arguments as a JSON object>")])
    return (f"{intro if intro is not None else _DEFAULT_TOOL_PROMPT}\n"
            f"{listing}\n"
            "To call one or more of them, answer with nothing but the calls, written exactly as:\n"
            f"{example}")


def messages_for_plain_template(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]],
                                fmt: ToolCallFormat, intro: str | None = None) -> list[dict[str, Any]]:
    """Messages a template that knows only {role, content} can render: the tools in the system
    message, an assistant's calls written in `fmt`, tool results as user turns."""
    rendered: list[dict[str, str]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if message.get("tool_calls"):
            content += fmt.render_calls([(call["function"]["name"], json.dumps(call["function"]["arguments"]))
                                         for call in message["tool_calls"]])
        if role == "tool":
            role, content = "user", fmt.result_open + content + fmt.result_close
        rendered.append({"role": role, "content": content})
    return with_system_text(rendered, tools_system_prompt(tools, fmt, intro)) if tools else rendered


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` at the end of the system message, which is added when there is none."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def check_tool_calls(message: Mapping[str, Any], position: int) -> None:
    """An assistant message's `tool_calls` as transformers' templates take them:
    [{"type": "function", "function": {"name": str, "arguments": object}}]."""
    calls = message.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ValidationError("inputs", f"message {position}: tool_calls must be a list")
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), dict):
            raise ValidationError("inputs", f"message {position}: each tool call needs a function "
                                            "with a string name and object arguments")
