"""apply_chat_template: `inputs` as a JSON list of {role, content} messages, or plain text as one
user message, rendered with the generation prompt by the adapter's template or else the base model's.

`inputs` may also be a JSON object {"messages": [...], "tools": [...], "tool_prompt": text} (the
OpenAI routes' tool calling): a template that renders tools gets them as transformers'
`apply_chat_template(tools=...)` passes them, with assistant `tool_calls` and `tool` results in the
history, and `tool_prompt` (TGI's) at the end of the system message; any other template gets them
through `lora_runtime.sampling.tools`' system prompt, in the request's call format (the template's
own, `lora_runtime.sampling.tool_grammar`), `tool_prompt` as its first line.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from lora_runtime.errors import ValidationError
from lora_runtime.sampling.tools import (
    check_tool_calls,
    messages_for_plain_template,
    template_knows_tools,
    tool_call_format,
    with_system_text,
)


@dataclass(frozen=True, slots=True)
class ChatInputs:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_prompt: str | None = None


def render_chat_prompt(inputs: str, tokenizer: Any, adapter_chat_template: str | None = None,
                       call_format: str = "auto") -> str:
    """The prompt text; encode it without adding special tokens again (the template has them).
    `call_format`: how a template that does not render tools is told to write calls ("auto": the
    format the template itself writes, `lora_runtime.sampling.tools.tool_call_format`)."""
    template = adapter_chat_template or tokenizer.chat_template
    if not template:
        raise ValidationError("apply_chat_template", "neither the adapter nor the base model has a chat template")
    chat = parse_chat_inputs(inputs)
    messages, tools = chat.messages, chat.tools or None
    if tools and not template_knows_tools(template):
        fmt = tool_call_format(template, call_format)
        messages, tools = messages_for_plain_template(messages, chat.tools, fmt, chat.tool_prompt), None
    elif tools and chat.tool_prompt:
        messages = with_system_text(messages, chat.tool_prompt)
    return tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )


def parse_chat_inputs(inputs: str) -> ChatInputs:
    """A JSON list is a message list and must be well formed (so is the object form); any other
    text is one user message."""
    try:
        document = json.loads(inputs)
    except json.JSONDecodeError:
        document = None
    if isinstance(document, dict) and isinstance(document.get("messages"), list):
        return _chat_with_tools(document)
    if not isinstance(document, list):
        return ChatInputs([{"role": "user", "content": inputs}])
    return ChatInputs(_checked_messages(document))


def _chat_with_tools(document: dict[str, Any]) -> ChatInputs:
    tools = document.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise ValidationError("inputs", "tools must be a list of objects")
    tool_prompt = document.get("tool_prompt")
    if tool_prompt is not None and not isinstance(tool_prompt, str):
        raise ValidationError("inputs", "tool_prompt must be a string")
    return ChatInputs(_checked_messages(document["messages"]), tools, tool_prompt)


def _checked_messages(document: list[Any]) -> list[dict[str, Any]]:
    if not document:
        raise ValidationError("inputs", "the message list is empty")
    for position, message in enumerate(document):
        _check_message(position, message)
    return [_kept_fields(m) for m in document]


def _kept_fields(message: dict[str, Any]) -> dict[str, Any]:
    """role and content, and the tool-calling fields templates read when present."""
    kept = {"role": message["role"], "content": message["content"]}
    for key in ("tool_calls", "tool_call_id"):
        if message.get(key) is not None:
            kept[key] = message[key]
    return kept


def _check_message(position: int, message: object) -> None:
    if not isinstance(message, dict):
        raise ValidationError("inputs", f"message {position} must be an object with 'role' and 'content'")
    for key in ("role", "content"):
        if not isinstance(message.get(key), str):
            raise ValidationError("inputs", f"message {position} needs a string '{key}'")
    if not message["role"]:
        raise ValidationError("inputs", f"message {position} has an empty role")
    check_tool_calls(message, position)
