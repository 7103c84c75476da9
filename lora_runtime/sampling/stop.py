"""When a request stops: max tokens, EOS, stop strings; and the text of tokens as they arrive.

Order of the checks after each token (API.md, SEMANTICS.md): length first, then EOS (unless
`ignore_eos_token`), then stop strings. A stop string is found in the decoded text, also when it spans
several tokens or ends inside a token (TGI only sees one that ends exactly at a token boundary); the
token that completes it is kept, so the stop text stays in the output.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from lora_runtime.core import FinishReason, SamplingParams

# Prompt tokens decoded together with the first generated one, so that a leading space or a
# multi-token character is rendered as it is in context (TGI keeps five too).
_CONTEXT_TOKENS = 5


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


class StopCriteria:
    """Decides after each generated token whether (and why) a request has finished."""

    __slots__ = ("_max_new_tokens", "_eos_token_ids", "_stops", "num_generated")

    def __init__(self, params: SamplingParams, eos_token_ids: Collection[int]) -> None:
        self._max_new_tokens = params.max_new_tokens
        self._eos_token_ids = frozenset() if params.ignore_eos_token else frozenset(eos_token_ids)
        self._stops = StopStringMatcher(params.stop)
        self.num_generated = 0

    def check(self, token_id: int, text_piece: str) -> FinishReason | None:
        """Call once per generated token with its id and its newly decoded text."""
        self.num_generated += 1
        stop_hit = self._stops.push(text_piece)
        if self.num_generated >= self._max_new_tokens:
            return "length"
        if token_id in self._eos_token_ids:
            return "eos_token"
        if stop_hit is not None:
            return "stop_sequence"
        return None


class IncrementalDecoder:
    """Turns generated ids into text pieces whose concatenation is the decoded text.

    Decodes a short window of ids and emits only what is new; a piece ending in an incomplete UTF-8
    sequence (U+FFFD) is held back until the next token completes it.
    """

    __slots__ = ("_tokenizer", "_ids", "_prefix_offset", "_read_offset", "_skip_special_tokens")

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._skip_special_tokens = skip_special_tokens

    def push(self, token_id: int) -> str:
        """The text `token_id` adds; "" while it is held back."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        # Forget ids before the window so that the decode stays short.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return full_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
