"""Constrained decoding with llguidance, for a JSON schema, a regex or a Lark grammar: compile once per
request, mask every step. All compile to an llguidance grammar and run on the same matcher.

Why llguidance rather than xgrammar (measured on SmolLM2-135M's tokenizer, 49152 ids, one CPU core,
four schemas: objects with bounds, arrays, enums, nested objects):
- per-token mask including unpacking the bitmask to a bool row: p50 0.07-0.11 ms llguidance,
  0.07-0.09 ms xgrammar, both far below a decode step, so speed does not decide;
- compiling a schema: 1-2 ms llguidance, 2-158 ms xgrammar (its first schema pays a warm-up);
- unsupported keywords (`uniqueItems`, `not`, `dependentRequired`, unknown `format`): llguidance
  refuses them, xgrammar silently ignores them and would return JSON that fails the schema. Refusing
  lets us answer 422 before generation instead of producing output that violates the request;
- llguidance is already a dependency; xgrammar would add a package (and apache-tvm-ffi).
The mask is applied with plain torch (llguidance's torch.compile helper took 92 s on its first call).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
import llguidance.hf
import torch

from lora_runtime.errors import ValidationError
from lora_runtime.sampling.response_format import JSON_COMPILE_OPTIONS

_BIT_POSITIONS = torch.arange(32, dtype=torch.int32)


class SchemaCompiler:
    """Owns llguidance's view of one tokenizer (building it costs ~1 s) and compiles schemas and
    regexes for it."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size  # the logits width, which may exceed the tokenizer's size
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=list(self.eos_token_ids)
        )

    def compile(self, schema: str | Mapping[str, Any]) -> str:
        """Compile a JSON-schema document (text or object) to a grammar, or raise ValidationError."""
        document = _parse_schema(schema)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(document, defaults=JSON_COMPILE_OPTIONS)
        except (ValueError, TypeError, RuntimeError) as error:
            raise ValidationError("schema", f"cannot compile the JSON schema: {error}") from error
        return self._checked(grammar, "schema", "the JSON schema")

    def compile_regex(self, regex: str) -> str:
        """Compile a regex that the whole output must match to a grammar, or raise ValidationError.

        The syntax is Rust's `regex` crate, which llguidance parses: no look-around, no backreferences
        (refused here); `\\d` and `\\w` are Unicode-aware, as in Python's `re` on text.
        """
        return self._checked(llguidance.LLMatcher.grammar_from_regex(regex), "regex", "the regex")

    def compile_lark(self, lark: str) -> str:
        """Check a grammar in llguidance's Lark dialect (the tool-call grammars of
        `lora_runtime.sampling.tools`), or raise ValidationError("lark_grammar")."""
        return self._checked(llguidance.LLMatcher.grammar_from_lark(lark), "lark_grammar", "the grammar")

    def _checked(self, grammar: str, field: str, what: str) -> str:
        """`grammar` if llguidance can enforce it over this tokenizer, else ValidationError(field)."""
        problem = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if problem:
            raise ValidationError(field, f"cannot enforce {what}: {problem}")
        return grammar

    def new_matcher(self, grammar: str) -> SchemaMatcher:
        return SchemaMatcher(llguidance.LLMatcher(self._tokenizer, grammar), self.vocab_size, self.eos_token_ids)


class SchemaMatcher:
    """The grammar state of one request: which tokens may come next, and the tokens taken so far."""

    __slots__ = ("_matcher", "_vocab_size", "_eos_only")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        assert not matcher.is_error(), matcher.get_error()
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos_only = torch.zeros(vocab_size, dtype=torch.bool)
        self._eos_only[list(eos_token_ids)] = True

    @property
    def is_complete(self) -> bool:
        """The document is finished: only EOS may follow."""
        return self._matcher.is_stopped()

    def allowed_tokens(self) -> torch.Tensor:
        """[vocab] bool on CPU: the tokens the grammar accepts next; only EOS once it is complete."""
        if self.is_complete:
            return self._eos_only
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)
        bits = (words[:, None] >> _BIT_POSITIONS) & 1  # [num_words, 32], bit j of word w = token 32w+j
        return bits.flatten()[: self._vocab_size].bool()

    def accept(self, token_id: int) -> None:
        """Advance over a sampled token; the mask guarantees the grammar accepts it."""
        accepted = self._matcher.consume_token(token_id)
        assert accepted, f"token {token_id} rejected by the grammar: {self._matcher.get_error()}"


def _parse_schema(schema: str | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(schema, Mapping):
        return dict(schema)
    try:
        document = json.loads(schema)
    except json.JSONDecodeError as error:
        raise ValidationError("schema", f"not valid JSON: {error}") from error
    if not isinstance(document, dict):
        raise ValidationError("schema", "a JSON schema must be a JSON object")
    return document
