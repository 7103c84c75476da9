"""Engine outputs to wire bodies, SSE events and the `x-*` headers (docs/api.md sections 4 and 5)."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

from lora_runtime.core import PrefillToken as EnginePrefillToken
from lora_runtime.core import RequestOutput, SamplingParams, TokenInfo
from server.protocol import (BestOfSequence, Details, GenerateResponse, PrefillToken, StreamDetails,
                             StreamResponse, Token)

# A logprob is always a finite number on the wire (lorax-client 0.6.3 breaks on null); -inf, from a
# masked token, becomes the lowest float32.
_LOWEST_LOGPROB = -3.4028234663852886e38


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOWEST_LOGPROB


def wire_token(token: TokenInfo) -> Token:
    return Token(id=token.id, text=token.text, logprob=_finite(token.logprob), special=token.special)


def _wire_prefill(tokens: list[EnginePrefillToken]) -> list[PrefillToken]:
    return [PrefillToken(id=t.id, text=t.text,
                         logprob=None if t.logprob is None else _finite(t.logprob)) for t in tokens]


def full_text(output: RequestOutput, inputs: str, params: SamplingParams) -> str:
    """The generated text, prefixed with the prompt as sent when `return_full_text`."""
    return inputs + output.text if params.return_full_text else output.text


def _best_of_sequence(output: RequestOutput, inputs: str, params: SamplingParams) -> BestOfSequence:
    return BestOfSequence(
        generated_text=full_text(output, inputs, params), finish_reason=output.finish_reason,
        generated_tokens=len(output.token_ids), seed=output.seed,
        prefill=_wire_prefill(output.prefill), tokens=[wire_token(t) for t in output.tokens])


def generate_response(output: RequestOutput, inputs: str, params: SamplingParams) -> GenerateResponse:
    details = None
    if params.details:
        others = [_best_of_sequence(o, inputs, params) for o in output.best_of_sequences]
        details = Details(
            finish_reason=output.finish_reason, prompt_tokens=len(output.prompt_token_ids),
            generated_tokens=len(output.token_ids), seed=output.seed,
            prefill=_wire_prefill(output.prefill), tokens=[wire_token(t) for t in output.tokens],
            best_of_sequences=others if params.best_of > 1 else None)
    return GenerateResponse(generated_text=full_text(output, inputs, params), details=details)


def stream_chunk(token: TokenInfo, final: RequestOutput | None, inputs: str,
                 params: SamplingParams) -> StreamResponse:
    """One SSE chunk; `final` is set on the last one, which carries the text and details."""
    if final is None:
        return StreamResponse(token=wire_token(token))
    details = None
    if params.details:
        details = StreamDetails(finish_reason=final.finish_reason,
                                prompt_tokens=len(final.prompt_token_ids),
                                generated_tokens=len(final.token_ids), seed=final.seed)
    return StreamResponse(token=wire_token(token), generated_text=full_text(final, inputs, params),
                          details=details)


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
