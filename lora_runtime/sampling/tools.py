"""Tool calls: the text format a model writes them in, which format a chat template writes, and the
prompt that offers the tools when the chat template cannot. The grammar that keeps every call well
formed is `lora_runtime.sampling.tool_grammar`.

A format is a family's own markup around a list of calls, each `{"name": N, "arguments": A}` with
compact separators: Hermes / Qwen `<tool_call>\\n{...}\\n</tool_call>` (one block per call), Mistral
`[TOOL_CALLS][{...}, {...}]`, Llama 3.x's JSON calls `{"name": N, "parameters": A}` (several
joined by "; "), which open the reply, bare or after `<|python_tag|>`. It is picked from the chat
template that renders the request (each writes its own markers) or by the operator; Hermes
otherwise, since it is what most open models fine-tuned for tools write.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lora_runtime.errors import ValidationError


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """`begin` call (`separator` call)* `end`. `trigger` marks the calls' start: in free text
    anywhere (a prefix of `begin`), or, when `opens_reply`, only as the reply's optional first
    marker (the calls then open the reply, with or without it). `markers` are the literals that
    tokenizers may hold as one special token. Tool results go back to a template that does not know
    tools between `result_open` and `result_close`, as a user turn."""

    name: str
    trigger: str
    begin: str
    separator: str
    end: str
    result_open: str
    result_close: str
    markers: tuple[str, ...]
    arguments_key: str = "arguments"
    opens_reply: bool = False

    def call_head(self, name: str) -> str:
        """The literal text of a call before its arguments."""
        return f'{{"name": {json.dumps(name)}, "{self.arguments_key}": '

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        """(name, arguments JSON) pairs as this format writes them."""
        bodies = [self.call_head(name) + arguments + "}" for name, arguments in calls]
        return self.begin + self.separator.join(bodies) + self.end


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat("hermes", "<tool_call>", "<tool_call>\n", "\n</tool_call>\n<tool_call>\n",
                             "\n</tool_call>", "<tool_response>\n", "\n</tool_response>",
                             markers=("<tool_call>", "</tool_call>")),
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS]", "[TOOL_CALLS][", ", ", "]",
                              "[TOOL_RESULTS]", "[/TOOL_RESULTS]", markers=("[TOOL_CALLS]",)),
    "llama3_json": ToolCallFormat("llama3_json", "<|python_tag|>", "", "; ", "", "Tool result: ", "",
                                  markers=("<|python_tag|>",), arguments_key="parameters", opens_reply=True),
}
# What in a chat template shows the format it writes, checked in this order: Mistral's marker,
# Hermes / Qwen's, then Llama 3.x's (its tool results go back as the `ipython` role).
_TEMPLATE_SIGNS = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"),
                   ("ipython", "llama3_json"))


def tool_call_format(chat_template: str | None, configured: str = "auto") -> ToolCallFormat:
    """The operator's (or request's) format, or under "auto" the one the chat template writes
    (Hermes by default)."""
    if configured != "auto":
        return TOOL_CALL_FORMATS[configured]
    name = next((name for sign, name in _TEMPLATE_SIGNS if chat_template and sign in chat_template), "hermes")
    return TOOL_CALL_FORMATS[name]


def template_knows_tools(chat_template: str) -> bool:
    """The template renders `tools` itself (transformers passes them as the `tools` variable)."""
    return "tools" in chat_template


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
