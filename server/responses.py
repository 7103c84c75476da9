"""Engine outputs to the TGI/LoRAX wire's bodies and SSE events, and the `x-*` headers of every
inference route (docs/api.md sections 4 and 5)."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from lora_runtime.api import PrefillToken as EnginePrefillToken, RequestOutput, SamplingParams, TokenInfo
from server.errors import ApiError, error_body
from server.protocol import (
    AlternativeToken,
    BestOfSequence,
    Details,
    GenerateResponse,
    PrefillToken,
    StreamDetails,
    StreamResponse,
    Token,
    TopToken,
)

# A logprob is always a finite number on the wire (lorax-client 0.6.3 breaks on null); -inf, from a
# masked token, becomes the lowest float32.
_LOWEST_LOGPROB = -3.4028234663852886e38


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOWEST_LOGPROB


@dataclass(frozen=True, slots=True)
class TopCounts:
    """How many of each generated token's most likely tokens the TGI wire shows, and where: TGI's
    `top_tokens` (`top_n_tokens`) and LoRAX's `alternative_tokens` (`return_k_alternatives`). The
    engine computes the larger count once (`SamplingParams.top_logprobs`); each takes its prefix."""

    top_n_tokens: int = 0
    alternatives: int = 0


def _top_tokens(token: TokenInfo, count: int) -> list[TopToken]:
    return [TopToken(id=t.id, text=t.text, logprob=finite(t.logprob), special=t.special)
            for t in token.top[:count]]


def wire_token(token: TokenInfo, counts: TopCounts) -> Token:
    alternatives = None
    if counts.alternatives:
        alternatives = [AlternativeToken(id=t.id, text=t.text, logprob=finite(t.logprob))
                        for t in token.top[:counts.alternatives]]
    return Token(id=token.id, text=token.text, logprob=finite(token.logprob), special=token.special,
                 alternative_tokens=alternatives)


def _wire_prefill(tokens: list[EnginePrefillToken]) -> list[PrefillToken]:
    return [PrefillToken(id=t.id, text=t.text,
                         logprob=None if t.logprob is None else finite(t.logprob)) for t in tokens]


def full_text(output: RequestOutput, inputs: str, params: SamplingParams) -> str:
    """The generated text, prefixed with the prompt as sent when `return_full_text`."""
    return inputs + output.text if params.return_full_text else output.text


class TgiAnswer:
    """The TGI/LoRAX wire (docs/api.md sections 4 and 5): one object (an array of one on the base
    route), or an event per token whose last carries the text and details."""

    def __init__(self, inputs: str, params: SamplingParams, counts: TopCounts, as_array: bool) -> None:
        self._inputs = inputs
        self._params = params
        self._counts = counts
        self._as_array = as_array
        self._num_sent = 0

    def complete(self, output: RequestOutput) -> Any:
        body = self.response(output).model_dump(mode="json", by_alias=True)
        return [body] if self._as_array else body

    def response(self, output: RequestOutput) -> GenerateResponse:
        details = None
        if self._params.details:
            others = [self._best_of_sequence(o) for o in output.best_of_sequences]
            details = Details(
                finish_reason=output.finish_reason, prompt_tokens=len(output.prompt_token_ids),
                generated_tokens=len(output.token_ids), seed=output.seed,
                prefill=_wire_prefill(output.prefill), tokens=self._tokens(output),
                top_tokens=self._top_tokens(output),
                best_of_sequences=others if self._params.best_of > 1 else None)
        return GenerateResponse(generated_text=full_text(output, self._inputs, self._params), details=details)

    def stream_payloads(self, output: RequestOutput) -> list[dict[str, Any]]:
        new_tokens = output.tokens[self._num_sent:]
        self._num_sent = len(output.tokens)
        payloads = []
        for index, token in enumerate(new_tokens):
            is_last = output.finished and index == len(new_tokens) - 1
            payloads.append(self._chunk(token, output if is_last else None).model_dump())
        return payloads

    def error_payload(self, error: ApiError) -> dict[str, Any]:
        return error_body(error.error_type, error.message)

    def stream_end(self) -> list[bytes]:
        return []  # the body simply ends (no `[DONE]`), as TGI's

    def _chunk(self, token: TokenInfo, final: RequestOutput | None) -> StreamResponse:
        """One event; `final` is set on the last one, which carries the text and details."""
        top = _top_tokens(token, self._counts.top_n_tokens) if self._counts.top_n_tokens else None
        if final is None:
            return StreamResponse(token=wire_token(token, self._counts), top_tokens=top)
        details = None
        if self._params.details:
            details = StreamDetails(finish_reason=final.finish_reason,
                                    prompt_tokens=len(final.prompt_token_ids),
                                    generated_tokens=len(final.token_ids), seed=final.seed)
        return StreamResponse(token=wire_token(token, self._counts), top_tokens=top,
                              generated_text=full_text(final, self._inputs, self._params),
                              details=details)

    def _tokens(self, output: RequestOutput) -> list[Token]:
        return [wire_token(t, self._counts) for t in output.tokens]

    def _top_tokens(self, output: RequestOutput) -> list[list[TopToken]] | None:
        if not self._counts.top_n_tokens:
            return None
        return [_top_tokens(t, self._counts.top_n_tokens) for t in output.tokens]

    def _best_of_sequence(self, output: RequestOutput) -> BestOfSequence:
        return BestOfSequence(
            generated_text=full_text(output, self._inputs, self._params),
            finish_reason=output.finish_reason, generated_tokens=len(output.token_ids),
            seed=output.seed, prefill=_wire_prefill(output.prefill), tokens=self._tokens(output),
            top_tokens=self._top_tokens(output))


def sse_event(payload: dict) -> bytes:
    return b"data:" + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_KEEPALIVE = b":\n\n"


@dataclass(frozen=True, slots=True)
class Timing:
    """Server-side timestamps (time.monotonic seconds) around one request."""

    received: float
    validated: float


def _ms(seconds: float) -> str:
    return f"{max(seconds, 0.0) * 1000:.3f}"


def generate_headers(output: RequestOutput, timing: Timing, identity: dict[str, str]) -> dict[str, str]:
    """The `x-*` headers of a finished request (times in milliseconds, as decimals)."""
    times = output.times
    finished = time.monotonic()
    num_prompt, num_generated = len(output.prompt_token_ids), len(output.token_ids)
    scheduled = (times.first_scheduled if times and times.first_scheduled else timing.validated)
    first_token = (times.first_token if times and times.first_token else finished)
    inference_s = finished - scheduled
    return {
        "x-prompt-tokens": str(num_prompt),
        "x-prompt-cached-tokens": str(output.num_cached_tokens),
        "x-generated-tokens": str(num_generated),
        "x-total-tokens": str(num_prompt + num_generated),
        "x-total-time": _ms(finished - timing.received),
        "x-time-per-token": _ms(inference_s / max(num_generated, 1)),
        "x-queue-time": _ms(scheduled - (times.arrival if times else timing.validated)),
        "x-time-to-first-token": _ms(first_token - timing.received),
        "x-validation-time": _ms(timing.validated - timing.received),
        "x-inference-time": _ms(inference_s),
        **identity,
    }
