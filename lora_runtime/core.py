"""The shared vocabulary of the engine: what a request asks for, its state, and what comes back.

`SamplingParams` is frozen and validated on construction; `Request` is mutated only by the scheduler
and the engine; `RequestOutput` is an immutable snapshot handed to callers.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from lora_runtime.errors import ValidationError

if TYPE_CHECKING:
    from lora_runtime.adapters.refs import AdapterKey

FinishReason = Literal["length", "eos_token", "stop_sequence"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Generation parameters, with the wire's names, defaults and ranges (docs/api.md section 2).

    Sampling is on when `do_sample` is set or any of temperature != 1, top_k, top_p < 1,
    typical_p < 1 is given; temperature 0 means greedy whatever else is set (docs/semantics.md).
    """

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos_token: bool = False
    best_of: int = 1
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool = False
    truncate: int | None = None
    watermark: bool = False
    schema: str | None = None
    apply_chat_template: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        _check_int("best_of", self.best_of, minimum=1)
        if self.temperature is not None:
            _check_float("temperature", self.temperature, "must be >= 0", lambda v: v >= 0)
        if self.top_k is not None:
            _check_int("top_k", self.top_k, minimum=1)
        if self.top_p is not None:
            _check_float("top_p", self.top_p, "must be in (0, 1]", lambda v: 0 < v <= 1)
        if self.typical_p is not None:
            _check_float("typical_p", self.typical_p, "must be in (0, 1]", lambda v: 0 < v <= 1)
        if self.repetition_penalty is not None:
            _check_float("repetition_penalty", self.repetition_penalty, "must be > 0", lambda v: v > 0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if self.truncate is not None:
            _check_int("truncate", self.truncate, minimum=1)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValidationError("stop", "every stop sequence must be a non-empty string")
        if self.best_of > 1 and not self.is_sampling:
            raise ValidationError("best_of", "best_of > 1 needs sampling (do_sample or a sampling parameter)")
        if self.best_of > 1 and self.seed is not None:
            # As TGI, and as its and LoRAX's clients check before sending: one seed cannot make
            # several candidates that differ.
            raise ValidationError("seed", "must not be set when best_of > 1")

    @property
    def is_sampling(self) -> bool:
        """True when tokens are drawn at random rather than by argmax."""
        if self.temperature == 0:
            return False
        return (
            self.do_sample
            or (self.temperature is not None and self.temperature != 1.0)
            or self.top_k is not None
            or (self.top_p is not None and self.top_p < 1.0)
            or (self.typical_p is not None and self.typical_p < 1.0)
        )


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(name, "must be an integer")
    if value < minimum:
        raise ValidationError(name, f"must be >= {minimum}")


def _check_float(name: str, value: object, rule: str, is_valid) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(name, "must be a number")
    if not math.isfinite(value) or not is_valid(value):
        raise ValidationError(name, rule)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED)


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """One generated token: its id, its text piece, its logprob and whether it is special."""

    id: int
    text: str
    logprob: float
    special: bool


@dataclass(frozen=True, slots=True)
class PrefillToken:
    """One prompt token with the logprob the model gave it; the first has none."""

    id: int
    text: str
    logprob: float | None


@dataclass(slots=True)
class RequestTimes:
    """Monotonic timestamps (seconds) of a request's life, for headers and metrics."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A snapshot of a request: cumulative tokens and text so far; final when `finished`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    tokens: list[TokenInfo] = field(default_factory=list)
    prefill: list[PrefillToken] = field(default_factory=list)
    seed: int | None = None
    best_of_sequences: list["RequestOutput"] = field(default_factory=list)
    times: RequestTimes | None = None
    error: Exception | None = None


@dataclass(slots=True, eq=False)
class Request:
    """A request's state inside the engine. Only the scheduler and the engine mutate it.

    `num_computed_tokens` counts the tokens whose K/V are in the cache; each step the scheduler grants
    some of the rest (`num_tokens - num_computed_tokens`), so prefill, chunked prefill, decode and
    recompute after preemption are one mechanism.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter_key: AdapterKey | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    arrival_order: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
