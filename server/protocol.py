"""Pydantic models of the wire format (docs/api.md sections 2, 4, 5).

Requests: every optional field accepts an explicit JSON `null` and unknown fields are ignored (the
official clients send nulls and fields of their own). Types are strict, so a string where a number
belongs is a 422 naming the field; value ranges are checked by `SamplingParams`.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

FinishReason = Literal["length", "eos_token", "stop_sequence"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class MergedAdapters(_Request):
    ids: list[str]
    weights: list[float] | None = None
    merge_strategy: str | None = None
    density: float | None = None
    majority_sign_method: str | None = None


class ResponseFormat(_Request):
    """LoRAX's form of a schema constraint: `{type: json_object|json_schema, schema}`."""

    type: Literal["json_object", "json_schema"]
    schema_: dict[str, Any] | str | None = Field(default=None, alias="schema")


class Grammar(_Request):
    """TGI's constraint: `json` (a JSON schema, as an object or a string) or `regex`."""

    type: Literal["json", "regex"]
    value: dict[str, Any] | str


class GenerateParameters(_Request):
    adapter_id: str | None = None
    adapter_source: str | None = None
    api_token: str | None = None
    merged_adapters: MergedAdapters | None = None
    best_of: int | None = None
    details: bool | None = None
    decoder_input_details: bool | None = None
    do_sample: bool | None = None
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None
    # TGI's definition: the token's share of the sequence so far (docs/semantics.md).
    frequency_penalty: float | None = None
    # The original interface's parameter table spells it this way; the correct spelling wins when
    # both are sent (docs/api.md section 2).
    repitition_penalty: float | None = None
    return_full_text: bool | None = None
    seed: int | None = None
    stop: list[str] | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    watermark: bool | None = None
    ignore_eos_token: bool | None = None
    schema_: dict[str, Any] | str | None = Field(
        default=None, validation_alias=AliasChoices("schema"), serialization_alias="schema")
    response_format: ResponseFormat | None = None
    grammar: Grammar | None = None
    apply_chat_template: bool | None = None
    # Roots the request's prefix-cache blocks at this secret (vLLM's name): 1..256 characters.
    cache_salt: str | None = None
    # TGI's `top_tokens` in details and stream events; LoRAX's `alternative_tokens` on each token.
    top_n_tokens: int | None = None
    return_k_alternatives: int | None = None


class GenerateRequest(_Request):
    inputs: str
    parameters: GenerateParameters | None = None


class CompatRequest(GenerateRequest):
    """The base route's body: the official clients choose streaming with `stream`."""

    stream: bool | None = None


# As TGI and LoRAX do, the top tokens and alternatives appear only when asked for.
_OMITTED_UNLESS_ASKED = Field(default=None, exclude_if=lambda value: value is None)


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None


class AlternativeToken(BaseModel):
    id: int
    text: str
    logprob: float


class TopToken(BaseModel):
    id: int
    text: str
    logprob: float
    special: bool


class Token(BaseModel):
    id: int
    text: str
    logprob: float
    special: bool
    skipped: bool = False
    alternative_tokens: list[AlternativeToken] | None = _OMITTED_UNLESS_ASKED


class BestOfSequence(BaseModel):
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    skipped_tokens: int = 0
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[TopToken]] | None = _OMITTED_UNLESS_ASKED


class Details(BaseModel):
    finish_reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[TopToken]] | None = _OMITTED_UNLESS_ASKED
    best_of_sequences: list[BestOfSequence] | None = None


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    seed: int | None


class StreamResponse(BaseModel):
    token: Token
    top_tokens: list[TopToken] | None = _OMITTED_UNLESS_ASKED
    generated_text: str | None = None
    details: StreamDetails | None = None


class ErrorResponse(BaseModel):
    error: str
    error_type: str
