"""A reply's tool calls, read back from its text: the content before the format's trigger, then
each call's name and arguments, the last one possibly still being written (streaming, or a reply
cut by max_tokens). The grammar wrote the text, so every literal is where the format puts it; the
reader still stops, rather than fails, at anything unexpected.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from lora_runtime.api import ToolCallFormat

_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments' JSON text so far
    complete: bool


@dataclass(frozen=True, slots=True)
class ParsedReply:
    content: str  # the text before the calls (all of it when there are none)
    calls: tuple[ParsedCall, ...]
    held: int  # characters at the end of `content` that may begin the trigger


def parse_reply(text: str, fmt: ToolCallFormat) -> ParsedReply:
    if fmt.opens_reply:
        return _reply_opened_by_calls(text, fmt)
    start = text.find(fmt.trigger)
    if start < 0:
        held = max((size for size in range(1, len(fmt.trigger)) if text.endswith(fmt.trigger[:size])), default=0)
        return ParsedReply(text, (), held)
    return ParsedReply(text[:start], tuple(_calls(text[start:], fmt)), 0)


def _reply_opened_by_calls(text: str, fmt: ToolCallFormat) -> ParsedReply:
    """A reply whose calls, if any, open it (after the optional trigger); the text so far is held
    while it may still become the trigger."""
    body = text.removeprefix(fmt.trigger)
    if body.startswith("{"):
        return ParsedReply("", tuple(_calls(body, fmt)), 0)
    if fmt.trigger.startswith(text):
        return ParsedReply(text, (), len(text))
    return ParsedReply(text, (), 0)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _calls(text: str, fmt: ToolCallFormat) -> list[ParsedCall]:
    """The calls of `text`, which starts with the format's `begin`."""
    calls: list[ParsedCall] = []
    position = _skip(text, 0, fmt.begin)
    while position is not None:
        call, position = _call(text, position, fmt)
        if call is None:
            break
        calls.append(call)
        if not call.complete or position is None:
            break
        position = _skip(text, position, fmt.separator)
    return calls


def _call(text: str, position: int, fmt: ToolCallFormat) -> tuple[ParsedCall | None, int | None]:
    """The call at `position` (None until its name is whole) and where the next one may begin."""
    position = _skip(text, position, '{"name": ')
    if position is None:
        return None, None
    try:
        name, position = _DECODER.raw_decode(text, position)
    except json.JSONDecodeError:
        return None, None
    position = _skip(text, position, f', "{fmt.arguments_key}": ')
    if position is None or not isinstance(name, str):
        return None, None
    try:
        _, end = _DECODER.raw_decode(text, position)
    except json.JSONDecodeError:
        return ParsedCall(name, text[position:], complete=False), None
    after = _skip(text, end, "}")
    return ParsedCall(name, text[position:end], complete=after is not None), after


def _skip(text: str, position: int, literal: str) -> int | None:
    """The position after `literal` at `position`, or None when the text does not go on with it."""
    return position + len(literal) if text.startswith(literal, position) else None
