"""Engine outputs in OpenAI's shapes: chat completions and (legacy) completions, whole or as SSE
chunks ending with `data: [DONE]` (docs/api.md section 8).

Differences from the TGI wire that OpenAI's clients rely on: a stop sequence is not part of the
text (held back while streaming until it is known not to be one); finish reasons are `stop` (EOS or
a stop sequence) and `length`; `n` choices are the best `n` candidates; usage counts every
returned choice's tokens. With tools, a reply's calls come back as `message.tool_calls` (streamed:
`delta.tool_calls`, the id and name with a call's first fragment, its arguments' text after) and
`finish_reason` is `tool_calls`.
"""
from __future__ import annotations

import importlib.metadata
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from lora_runtime.api import TOOL_CALL_FORMATS, RequestOutput, SamplingParams, TokenInfo, TopToken
from server.errors import ApiError, openai_error_body
from server.openai_api.tool_calls import ParsedCall, ParsedReply, new_call_id, parse_reply
from server.responses import finite, sse_event

_DONE = b"data: [DONE]\n\n"
# OpenAI's field naming the backend's configuration (its values change when outputs may); TGI's
# client requires it. This server's: its release.
SYSTEM_FINGERPRINT = "fp_lora_serve_" + importlib.metadata.version("lora-serve")


def _finish_reason(output: RequestOutput) -> str | None:
    if output.finish_reason is None:
        return None
    return "length" if output.finish_reason == "length" else "stop"


def _matched_stop(text: str, stops: tuple[str, ...]) -> str:
    """The stop sequence `text` ends with (the longest, when several do)."""
    return max((stop for stop in stops if text.endswith(stop)), key=len, default="")


def visible_text(output: RequestOutput, stops: tuple[str, ...]) -> str:
    """The text a client may see now: without the stop sequence that ended it, and while
    generating, without a tail that may still become one."""
    text = output.text
    if output.finish_reason is not None:
        return text[: len(text) - len(_matched_stop(text, stops))] if output.finish_reason == "stop_sequence" else text
    held = max((size for stop in stops for size in range(1, len(stop))
                if text.endswith(stop[:size])), default=0)
    return text[: len(text) - held]


def _choices(output: RequestOutput, n: int) -> list[RequestOutput]:
    """The answer's `n` choices: the engine's winner, then the other candidates best first (or a
    fanned-out request's choices in order, `server.fan_out`)."""
    return [output, *output.best_of_sequences][:n]


def _usage(choices: list[RequestOutput], choices_per_prompt: int) -> dict[str, Any]:
    """Each prompt counted once, every returned choice's tokens."""
    firsts = choices[::choices_per_prompt]
    prompt = sum(len(choice.prompt_token_ids) for choice in firsts)
    completion = sum(len(choice.token_ids) for choice in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(choice.num_cached_tokens for choice in firsts)}}


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _chat_top(top: tuple[TopToken, ...]) -> list[dict[str, Any]]:
    return [{"token": t.text, "logprob": finite(t.logprob), "bytes": _token_bytes(t.text)} for t in top]


def _chat_logprobs(tokens: list[TokenInfo]) -> dict[str, Any]:
    return {"content": [{"token": t.text, "logprob": finite(t.logprob), "bytes": _token_bytes(t.text),
                         "top_logprobs": _chat_top(t.top)} for t in tokens]}


@dataclass(slots=True)
class _ChoiceProgress:
    """What a stream has sent of one choice."""

    num_chars_sent: int = 0
    num_tokens_sent: int = 0
    num_chunks_sent: int = 0
    is_open: bool = False
    is_finish_sent: bool = False
    reply: ParsedReply = ParsedReply("", (), 0)  # chat with tools: the reply read so far
    call_ids: list[str] = field(default_factory=list)
    num_argument_chars_sent: list[int] = field(default_factory=list)


class _OpenAIAnswer:
    """What the chat and completions answers share: ids, the stream's text deltas per choice,
    usage, the end. `n` counts every choice (prompts x n for a list of prompts), in order, each
    prompt's `choices_per_prompt` together."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, model: str, params: SamplingParams, n: int, include_usage: bool,
                 choices_per_prompt: int | None = None) -> None:
        self.model = model
        self.params = params
        self.n = n
        self.choices_per_prompt = choices_per_prompt or n
        self.include_usage = include_usage
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._progress = [_ChoiceProgress() for _ in range(n)]
        self._final: RequestOutput | None = None
        self._failed = False

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices}

    def complete(self, output: RequestOutput) -> dict[str, Any]:
        choices = _choices(output, self.n)
        body = self._envelope(self.object_name, [self._choice(index, choice)
                                                 for index, choice in enumerate(choices)])
        body["usage"] = _usage(choices, self.choices_per_prompt)
        return body

    def stream_payloads(self, output: RequestOutput) -> list[dict[str, Any]]:
        """Each choice's news as its own chunks (choices interleave, told apart by `index`)."""
        payloads = []
        for index, choice in enumerate(_choices(output, self.n)):
            progress = self._progress[index]
            payloads += self._opening_payloads(index, progress)
            progress.is_open = True
            text = self._stream_text(choice, progress)
            delta, progress.num_chars_sent = text[progress.num_chars_sent:], len(text)
            tokens, progress.num_tokens_sent = choice.tokens[progress.num_tokens_sent:], len(choice.tokens)
            ends = (choice.finish_reason is not None or output.finished) and not progress.is_finish_sent
            if delta or tokens or ends:
                chunk = self._chunk_choice(index, delta, tokens, choice, progress)
                payloads.append(self._with_usage_field(self._envelope(self.chunk_object_name, [chunk])))
                progress.num_chunks_sent += 1
            progress.is_finish_sent |= ends
        if output.finished:
            self._final = output
        return payloads

    def error_payload(self, error: ApiError) -> dict[str, Any]:
        self._failed = True
        return openai_error_body(error)

    def stream_end(self) -> list[bytes]:
        tail = []
        if self.include_usage and self._final is not None and not self._failed:
            usage = self._envelope(self.chunk_object_name, [])
            usage["usage"] = _usage(_choices(self._final, self.n), self.choices_per_prompt)
            tail.append(sse_event(usage))
        return [*tail, _DONE]

    def _with_usage_field(self, payload: dict[str, Any]) -> dict[str, Any]:
        # With include_usage every chunk carries `usage: null`, and a last one with no choices the usage.
        if self.include_usage:
            payload["usage"] = None
        return payload

    def _opening_payloads(self, index: int, progress: _ChoiceProgress) -> list[dict[str, Any]]:
        return []

    def _stream_text(self, choice: RequestOutput, progress: _ChoiceProgress) -> str:
        """The choice's text streamed so far."""
        return visible_text(choice, self.params.stop)

    def _choice(self, index: int, output: RequestOutput) -> dict[str, Any]:
        raise NotImplementedError

    def _chunk_choice(self, index: int, delta: str, tokens: list[TokenInfo], choice: RequestOutput,
                      progress: _ChoiceProgress) -> dict[str, Any]:
        raise NotImplementedError


class ChatAnswer(_OpenAIAnswer):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model: str, params: SamplingParams, n: int, include_usage: bool, logprobs: bool) -> None:
        super().__init__(model, params, n, include_usage)
        self.logprobs = logprobs

    def _choice(self, index: int, output: RequestOutput) -> dict[str, Any]:
        text = visible_text(output, self.params.stop)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls: tuple[ParsedCall, ...] = ()
        if output.tool_call_format is not None:
            reply = parse_reply(text, TOOL_CALL_FORMATS[output.tool_call_format])
            calls = reply.calls
            if calls:
                message["content"] = reply.content or None
                message["tool_calls"] = [_tool_call(new_call_id(), call.name, call.arguments) for call in calls]
        return {"index": index, "message": message,
                "logprobs": _chat_logprobs(output.tokens) if self.logprobs else None,
                "finish_reason": _tool_finish_reason(output, calls)}

    def _stream_text(self, choice: RequestOutput, progress: _ChoiceProgress) -> str:
        text = visible_text(choice, self.params.stop)
        if choice.tool_call_format is None:
            return text
        progress.reply = parse_reply(text, TOOL_CALL_FORMATS[choice.tool_call_format])
        held = 0 if choice.finish_reason is not None else progress.reply.held
        return progress.reply.content[: len(progress.reply.content) - held]

    def _opening_payloads(self, index: int, progress: _ChoiceProgress) -> list[dict[str, Any]]:
        """A choice's first chunk names the role, as OpenAI's does."""
        if progress.is_open:
            return []
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return [self._with_usage_field(self._envelope(self.chunk_object_name, [choice]))]

    def _chunk_choice(self, index: int, delta: str, tokens: list[TokenInfo], choice: RequestOutput,
                      progress: _ChoiceProgress) -> dict[str, Any]:
        message: dict[str, Any] = {"content": delta} if delta else {}
        tool_calls = _tool_call_deltas(progress)
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "delta": message,
                "logprobs": _chat_logprobs(tokens) if self.logprobs and tokens else None,
                "finish_reason": _tool_finish_reason(choice, progress.reply.calls)}


def _tool_call_deltas(progress: _ChoiceProgress) -> list[dict[str, Any]]:
    """Each call's news since the last chunk: its id and name first, then its arguments' text."""
    deltas = []
    for index, call in enumerate(progress.reply.calls):
        if index == len(progress.call_ids):
            progress.call_ids.append(new_call_id())
            progress.num_argument_chars_sent.append(0)
            deltas.append({"index": index, **_tool_call(progress.call_ids[index], call.name, call.arguments)})
        elif len(call.arguments) > progress.num_argument_chars_sent[index]:
            fragment = call.arguments[progress.num_argument_chars_sent[index]:]
            deltas.append({"index": index, "function": {"arguments": fragment}})
        progress.num_argument_chars_sent[index] = len(call.arguments)
    return deltas


class CompletionAnswer(_OpenAIAnswer):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, params: SamplingParams, n: int, include_usage: bool,
                 logprobs: int | None, echo_texts: list[str] | None, choices_per_prompt: int) -> None:
        super().__init__(model, params, n, include_usage, choices_per_prompt)
        self.logprobs = logprobs
        self.echo_texts = echo_texts  # each prompt as text, when echoed

    def _echo(self, index: int) -> str | None:
        return None if self.echo_texts is None else self.echo_texts[index // self.choices_per_prompt]

    def _choice(self, index: int, output: RequestOutput) -> dict[str, Any]:
        text = visible_text(output, self.params.stop)
        echo = self._echo(index)
        logprobs = None
        if self.logprobs is not None:
            logprobs = self._logprobs(output.tokens, with_prompt=output if echo is not None else None)
        return {"index": index, "text": (echo or "") + text, "logprobs": logprobs,
                "finish_reason": _finish_reason(output)}

    def _chunk_choice(self, index: int, delta: str, tokens: list[TokenInfo], choice: RequestOutput,
                      progress: _ChoiceProgress) -> dict[str, Any]:
        # The first chunk of a choice carries its echoed prompt (and the prompt's logprobs).
        echo = None if progress.num_chunks_sent else self._echo(index)
        logprobs = None
        if self.logprobs is not None and (tokens or echo is not None):
            logprobs = self._logprobs(tokens, with_prompt=choice if echo is not None else None)
        return {"index": index, "text": (echo or "") + delta, "logprobs": logprobs,
                "finish_reason": _finish_reason(choice)}

    def _logprobs(self, tokens: list[TokenInfo], with_prompt: RequestOutput | None) -> dict[str, Any]:
        """The legacy shape: parallel lists, the top entries as {token: logprob} (the chosen token
        included, as OpenAI's are), offsets into the returned text."""
        texts: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if with_prompt is not None:
            for index, token in enumerate(with_prompt.prefill):
                texts.append(token.text)
                token_logprobs.append(None if token.logprob is None else finite(token.logprob))
                tops.append(None if index == 0 else _top_dict(token.top, token.text, token.logprob))
        for token in tokens:
            texts.append(token.text)
            token_logprobs.append(finite(token.logprob))
            tops.append(_top_dict(token.top, token.text, token.logprob))
        offsets, position = [], 0
        for text in texts:
            offsets.append(position)
            position += len(text)
        return {"tokens": texts, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}


def _tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_finish_reason(output: RequestOutput, calls: tuple[ParsedCall, ...]) -> str | None:
    """`tool_calls` when the reply ended after its calls (not cut by max_tokens)."""
    reason = _finish_reason(output)
    return "tool_calls" if calls and reason == "stop" else reason


def _top_dict(top: tuple[TopToken, ...], text: str, logprob: float | None) -> dict[str, float]:
    entries = {t.text: finite(t.logprob) for t in top}
    if logprob is not None:
        entries.setdefault(text, finite(logprob))
    return entries
