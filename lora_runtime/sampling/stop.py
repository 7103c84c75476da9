"""When a request stops: max tokens, EOS, stop strings.

Order of the checks after each token (docs/api.md section 2, docs/semantics.md): length first,
then EOS (unless `ignore_eos_token`), then stop strings. A stop string is found in the decoded text,
also when it spans several tokens or ends inside a token (TGI only sees one that ends exactly at a
token boundary); the token that completes it is kept, so the stop text stays in the output.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

from lora_runtime.core import FinishReason, SamplingParams



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
