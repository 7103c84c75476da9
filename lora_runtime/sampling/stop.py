"""When a request stops: max tokens, EOS, stop strings.

Order of the checks after each token (docs/api.md section 2, docs/semantics.md): length first,
then EOS (unless `ignore_eos_token`), then stop strings. A stop string is found in the decoded text,
also when it spans several tokens or ends inside a token (TGI only sees one that ends exactly at a
token boundary); the token that completes it is kept, so the stop text stays in the output.

A reply that may hold tool calls is checked for stop strings in its free text only (`FreeText`): a
stop string never cuts a call, so every call stays well formed; where calls begin, stops end.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

from lora_runtime.core import FinishReason, SamplingParams
from lora_runtime.sampling.tools import TOOL_CALL_FORMATS


class StopStringMatcher:
    """Finds the first stop string in a text that arrives piece by piece."""

    __slots__ = ("_stops", "_tail", "_tail_len")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._tail = ""
        # The longest text a stop string can have before the new piece: one char short of the longest.
        self._tail_len = max((len(s) for s in self._stops), default=1) - 1

    def push(self, piece: str) -> str | None:
        """Append `piece`; return the stop string it completes, if any."""
        if not self._stops:
            return None
        window = self._tail + piece
        self._tail = window[-self._tail_len :] if self._tail_len else ""
        hits = [(window.find(s) + len(s), s) for s in self._stops if s in window]
        return min(hits)[1] if hits else None


class FreeText:
    """The free text of a reply that may hold tool calls, as it arrives: the text before the
    calls' trigger, released once it cannot be the trigger's beginning; none when the calls come
    first (`required`, a named tool) or open the reply."""

    __slots__ = ("_trigger", "_opens_reply", "_text", "_num_released", "_is_over")

    def __init__(self, trigger: str, free_text_first: bool, opens_reply: bool) -> None:
        self._trigger = trigger
        self._opens_reply = opens_reply
        self._text = ""
        self._num_released = 0
        self._is_over = not free_text_first

    def push(self, piece: str) -> str:
        """Append `piece`; return the free text it releases."""
        if self._is_over:
            return ""
        self._text += piece
        end = self._free_text_end()
        released, self._num_released = self._text[self._num_released:end], max(end, self._num_released)
        return released

    def _free_text_end(self) -> int:
        """How far the text is free (sets `_is_over` where the calls begin)."""
        text, trigger = self._text, self._trigger
        if self._opens_reply:
            if text.startswith(("{", trigger)):
                self._is_over = True
                return 0
            return 0 if trigger.startswith(text) else len(text)
        start = text.find(trigger, self._num_released)
        if start >= 0:
            self._is_over = True
            return start
        held = max((size for size in range(1, len(trigger)) if text.endswith(trigger[:size])), default=0)
        return len(text) - held


def free_text_of(params: SamplingParams) -> FreeText | None:
    """The reply's free text when it may hold tool calls (the format resolved by the engine)."""
    calling = params.tool_calling
    if calling is None or not calling.reads_calls:
        return None
    fmt = TOOL_CALL_FORMATS[calling.call_format]
    return FreeText(fmt.trigger, calling.free_text_first, fmt.opens_reply)


class StopCriteria:
    """Decides after each generated token whether (and why) a request has finished."""

    __slots__ = ("_max_new_tokens", "_eos_token_ids", "_stops", "_free_text", "num_generated")

    def __init__(self, params: SamplingParams, eos_token_ids: Collection[int]) -> None:
        self._max_new_tokens = params.max_new_tokens
        self._eos_token_ids = frozenset() if params.ignore_eos_token else frozenset(eos_token_ids)
        self._stops = StopStringMatcher(params.stop)
        self._free_text = free_text_of(params)  # None: the whole text is free
        self.num_generated = 0

    def check(self, token_id: int, text_piece: str) -> FinishReason | None:
        """Call once per generated token with its id and its newly decoded text."""
        self.num_generated += 1
        free_piece = text_piece if self._free_text is None else self._free_text.push(text_piece)
        stop_hit = self._stops.push(free_piece)
        if self.num_generated >= self._max_new_tokens:
            return "length"
        if token_id in self._eos_token_ids:
            return "eos_token"
        if stop_hit is not None:
            return "stop_sequence"
        return None
