"""The chat stream in TGI's shape, for TGI's own client (`text-generation`, which sends `model:
"tgi"`) on the chat route: TGI 2.x's chunks, which its client's types require.

What TGI 2.x sends and its client checks, and OpenAI's stream does not: every delta names its
`role` and carries `tool_calls` (null without a call); `tool_calls` is one object, not a list
(`{index, id, type: "function", function: {name, arguments}}`, `arguments` always a string), so
news of two calls takes two chunks; the stream ends with the body, no `data: [DONE]` (the client
would try to read it as JSON). Where TGI 2.x left `id` empty and `name` null and streamed the raw
text of its own `{"function": {"_name": ...}}` document as `arguments`, this server sends the
call's id and name with its first fragment and then the arguments' text, as on OpenAI's stream.
"""
from __future__ import annotations

from typing import Any

from lora_runtime.api import RequestOutput
from server.openai_api.answers import ChatAnswer


class TgiChatAnswer(ChatAnswer):
    def stream_payloads(self, output: RequestOutput) -> list[dict[str, Any]]:
        return [tgi for payload in super().stream_payloads(output) for tgi in _tgi_chunks(payload)]

    def stream_end(self) -> list[bytes]:
        return super().stream_end()[:-1]  # without `data: [DONE]`


def _tgi_chunks(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """An OpenAI chunk of one choice as TGI's: one chunk per tool-call delta, the finish reason on
    the last."""
    choice = payload["choices"][0]
    delta = choice["delta"]
    calls = delta.get("tool_calls") or [None]
    chunks = []
    for position, call in enumerate(calls):
        tgi_delta = {"role": "assistant", "tool_calls": None if call is None else _tgi_call(call)}
        if position == 0 and "content" in delta:
            tgi_delta["content"] = delta["content"]
        is_last = position == len(calls) - 1
        tgi_choice = {**choice, "delta": tgi_delta, "finish_reason": choice["finish_reason"] if is_last else None}
        chunks.append({**payload, "choices": [tgi_choice]})
    return chunks


def _tgi_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {"index": call["index"], "id": call.get("id", ""), "type": "function",
            "function": {"name": function.get("name"), "arguments": function.get("arguments", "")}}
