"""Incremental detokenization: text pieces per generated token that add up to the decoded text.

Decoding one token alone is wrong in two ways: byte-level tokens of a multi-byte character decode to
U+FFFD until the character is complete, and some tokenizers drop a leading space at the start of a
decode. So each step decodes a short window of preceding tokens and emits only the new suffix, and
holds text back while it ends in an incomplete character.

Special tokens add no text, except the ones a request keeps: the markers of its tool calls, which
the reply is read back by (`lora_runtime.sampling.tool_grammar`); each adds its own text.
"""
from __future__ import annotations

from collections.abc import Collection

# Tokens of context decoded before the new ones, enough for any merge to settle.
_CONTEXT_TOKENS = 6
_INCOMPLETE = "\ufffd"


class TokenTexts:
    """Each token's text on its own (special tokens included), decoded once per tokenizer: every step
    asks it for every request's new token and its top alternatives, the same few thousand ids."""

    __slots__ = ("_tokenizer", "_texts")

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # at most the vocabulary

    def __getitem__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


class IncrementalDetokenizer:
    """Per-request state: feed generated token ids one at a time, get the new text of each. Requests
    of one tokenizer share its `TokenTexts` (one of its own when not given)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], kept_special_ids: Collection[int] = (),
                 token_texts: TokenTexts | None = None) -> None:
        self._tokenizer = tokenizer
        self._token_texts = token_texts if token_texts is not None else TokenTexts(tokenizer)
        self._special_ids = set(tokenizer.all_special_ids) | set(kept_special_ids)
        self._kept_special_ids = frozenset(kept_special_ids)
        context = [t for t in prompt_token_ids[-_CONTEXT_TOKENS:] if t not in self._special_ids]
        self._token_ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self.text = ""

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own, as shown in token details (special tokens included)."""
        return self._token_texts[token_id]

    def add_token(self, token_id: int) -> str:
        """Append a generated token; return the text it completes ('' while a character is partial).
        Special tokens add no text (they are skipped, as in the final decode), but for kept ones,
        which add theirs (outside the decoding window, which skips them as any special token)."""
        if token_id in self._kept_special_ids:
            piece = self.token_text(token_id)
            self.text += piece
            return piece
        if token_id in self._special_ids:
            return ""
        self._token_ids.append(token_id)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._token_ids))
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return ""
        piece = full[len(prefix):]
        self._prefix_offset = max(self._read_offset, len(self._token_ids) - _CONTEXT_TOKENS)
        self._read_offset = len(self._token_ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """At the end of generation, return text still held back (an incomplete final character)."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._token_ids))
        piece = full[len(prefix):] if len(full) > len(prefix) else ""
        self._read_offset = len(self._token_ids)
        self.text += piece
        return piece

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._token_ids[start:end], skip_special_tokens=True)
