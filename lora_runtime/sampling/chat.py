"""apply_chat_template: `inputs` as a JSON list of {role, content} messages, or plain text as one
user message, rendered with the generation prompt by the adapter's template or else the base model's."""
from __future__ import annotations

import json
from typing import Any

from lora_runtime.errors import ValidationError


def render_chat_prompt(inputs: str, tokenizer: Any, adapter_chat_template: str | None = None) -> str:
    """The prompt text; encode it without adding special tokens again (the template has them)."""
    template = adapter_chat_template or tokenizer.chat_template
    if not template:
        raise ValidationError("apply_chat_template", "neither the adapter nor the base model has a chat template")
    return tokenizer.apply_chat_template(
        parse_messages(inputs), chat_template=template, tokenize=False, add_generation_prompt=True
    )


def parse_messages(inputs: str) -> list[dict[str, str]]:
    """A JSON list is a message list and must be well formed; any other text is one user message."""
    try:
        document = json.loads(inputs)
    except json.JSONDecodeError:
        document = None
    if not isinstance(document, list):
        return [{"role": "user", "content": inputs}]
    if not document:
        raise ValidationError("inputs", "the message list is empty")
    for position, message in enumerate(document):
        _check_message(position, message)
    return [{"role": m["role"], "content": m["content"]} for m in document]


def _check_message(position: int, message: object) -> None:
    if not isinstance(message, dict):
        raise ValidationError("inputs", f"message {position} must be an object with 'role' and 'content'")
    for key in ("role", "content"):
        if not isinstance(message.get(key), str):
            raise ValidationError("inputs", f"message {position} needs a string '{key}'")
    if not message["role"]:
        raise ValidationError("inputs", f"message {position} has an empty role")
