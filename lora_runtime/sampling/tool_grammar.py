"""The llguidance grammar that makes every tool call well formed, built per request once the chat
template that renders it is known (the adapter's own, else the base model's), since that template
decides the call format (`lora_runtime.sampling.tools`).

The grammar constrains from the first token (`required`, a named tool), or under `auto` leaves the
text free until the format's trigger appears (a lazy lexeme: llguidance ends the free text at the
first trigger; a format whose calls open the reply decides on its first character), then forces the
calls. Each call's arguments follow that tool's JSON schema (llguidance's `%json`), with the same
compact separators as `response_format`.

A marker that the tokenizer holds as one special token (Qwen's `<tool_call>` in some releases,
Llama's `<|python_tag|>`, Mistral's `[TOOL_CALLS]`) is accepted as that token as well as spelt in
text pieces: llguidance matches special tokens only where the grammar names them (`<[id]>`), so a
text literal alone would keep a model from writing the one token it was trained to write.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from lora_runtime.core import SamplingParams, ToolCalling
from lora_runtime.errors import ValidationError
from lora_runtime.sampling.schema import JSON_COMPILE_OPTIONS
from lora_runtime.sampling.tools import ToolCallFormat, tool_call_format

# The engine compiles a request's grammar on its loop thread, between steps: this bounds that pause
# (a 43 KB grammar of 16 tools with 12 arguments each: ~80 ms to check and compile on one CPU core,
# growing about linearly). The server bounds each tool's schema (server.openai_api.tools).
MAX_GRAMMAR_CHARS = 64 * 1024


def with_tool_grammar(params: SamplingParams, chat_template: str | None, tokenizer: Any) -> SamplingParams:
    """`params` with its tools' call format resolved from `chat_template` and, when the reply may
    hold calls, the grammar that keeps them well formed; `params` itself without tools."""
    calling = params.tool_calling
    if calling is None:
        return params
    fmt = tool_call_format(chat_template, calling.call_format)
    resolved = dataclasses.replace(calling, call_format=fmt.name)
    if not calling.reads_calls:
        return dataclasses.replace(params, tool_calling=resolved)
    grammar = tool_call_grammar(calling, fmt, special_marker_ids(tokenizer, fmt))
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise ValidationError("tools", f"the offered tools' grammar is {len(grammar)} characters; "
                                       f"at most {MAX_GRAMMAR_CHARS} (offer fewer or smaller schemas)")
    return dataclasses.replace(params, tool_calling=resolved, lark_grammar=grammar)


def special_marker_ids(tokenizer: Any, fmt: ToolCallFormat) -> dict[str, int]:
    """{marker: token id} for the format's markers that `tokenizer` holds as one special token (an
    added token marked special, which decoding skips and llguidance matches only by id)."""
    special = {token.content: token_id for token_id, token in tokenizer.added_tokens_decoder.items()
               if token.special}
    return {marker: special[marker] for marker in fmt.markers if marker in special}


def tool_call_grammar(calling: ToolCalling, fmt: ToolCallFormat, special_ids: Mapping[str, int] | None = None) -> str:
    """The Lark grammar (llguidance's dialect) of a reply under `calling`."""
    special_ids = special_ids or {}
    alternatives = " | ".join(f"call_{index}" for index in range(len(calling.callable_names)))
    body = _sequence(_literal(fmt.begin, special_ids), "calls", _literal(fmt.end, special_ids))
    lines = ["%llguidance {}", *_start(calling, fmt, body, special_ids),
             f"calls: {'call (separator call)*' if calling.parallel else 'call'}",
             f"call: {alternatives}", f"separator: {_literal(fmt.separator, special_ids)}"]
    schemas = dict(calling.tools)
    for index, name in enumerate(calling.callable_names):
        schema = json.dumps(_compact(schemas[name]))
        lines.append(f"call_{index}: {_literal(fmt.call_head(name), {})} %json {schema} \"}}\"")
    return "\n".join(lines) + "\n"


def _start(calling: ToolCalling, fmt: ToolCallFormat, body: str, special_ids: Mapping[str, int]) -> list[str]:
    """The start rule and its free text, for the three ways a reply may begin."""
    trigger = _literal(fmt.trigger, special_ids)
    if fmt.opens_reply:
        calls = f"({trigger})? {body}"
        if not calling.free_text_first:
            return [f"start: {calls}"]
        # Free text is anything that does not open as a call.
        opening = "|".join(re.escape(text).replace("/", "\\/") for text in ("{", fmt.trigger))
        return [f"start: TEXT | {calls}", rf"TEXT: /(.|\n)*/ & ~/({opening})(.|\n)*/"]
    if not calling.free_text_first:
        return [f"start: {body}"]
    rest = _sequence(_literal(fmt.begin[len(fmt.trigger):], special_ids), "calls", _literal(fmt.end, special_ids))
    start = f"start: TEXT | trigger {rest}"
    if fmt.trigger in special_ids:  # the special token ends the free text by itself
        start += f" | TEXT <[{special_ids[fmt.trigger]}]> {rest}"
    return [start, f"trigger[lazy]: TEXT {json.dumps(fmt.trigger)}", r"TEXT: /(.|\n)*/"]


def _literal(text: str, special_ids: Mapping[str, int]) -> str:
    """`text` as Lark items: quoted text (Lark's string literals take JSON's escapes), each marker
    that is a special token as that token or its text."""
    markers = [marker for marker in special_ids if marker in text]
    if not markers:
        return json.dumps(text) if text else ""
    pieces = re.split("(" + "|".join(map(re.escape, markers)) + ")", text)
    items = [f'(<[{special_ids[piece]}]> | {json.dumps(piece)})' if piece in special_ids else json.dumps(piece)
             for piece in pieces if piece]
    return " ".join(items)


def _sequence(*items: str) -> str:
    return " ".join(item for item in items if item)


def _compact(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The schema with the compact separators, unless it sets its own llguidance options."""
    options = {**JSON_COMPILE_OPTIONS, **schema.get("x-guidance", {})}
    return {**schema, "x-guidance": options}
