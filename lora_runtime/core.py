"""The shared vocabulary of the engine: what a request asks for, its state, and what comes back.

`SamplingParams` is frozen and validated on construction; `Request` is mutated only by the scheduler
and the engine; `RequestOutput` is an immutable snapshot handed to callers.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from lora_runtime.errors import ValidationError

if TYPE_CHECKING:
    from lora_runtime.adapters.refs import AdapterKey

FinishReason = Literal["length", "eos_token", "stop_sequence"]
PenaltyCounts = Literal["output", "sequence_fraction"]
PENALTY_COUNTS: tuple[PenaltyCounts, ...] = ("output", "sequence_fraction")
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on logit_bias entries
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_CACHE_SALT_CHARS = 256


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """A chat request's tools as decoding needs them: each offered tool's (name, arguments schema),
    the names a reply may call (none under tool_choice "none": the tools are only shown), whether
    text may come first (`auto`), whether several calls may follow one another, and the call format:
    "auto" (the one the chat template that renders the request writes: the adapter's own, else the
    base model's) or a format's name. The engine resolves "auto" when it renders the prompt and
    constrains the reply with the format's grammar (`lora_runtime.sampling.tool_grammar`)."""

    tools: tuple[tuple[str, Mapping[str, Any]], ...]
    callable_names: tuple[str, ...]
    free_text_first: bool
    parallel: bool
    call_format: str = "auto"

    @property
    def reads_calls(self) -> bool:
        """The reply may hold calls (its grammar is built, and it is read back for them)."""
        return bool(self.callable_names)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Generation parameters, with the wire's names, defaults and ranges (docs/api.md section 2).

    Sampling is on when `do_sample` is set or any of temperature != 1, top_k, top_p < 1,
    typical_p < 1 is given; temperature 0 means greedy whatever else is set (docs/semantics.md).
    The penalties, `logit_bias`, `schema` and `regex` change the scores, never whether sampling is on.
    `logit_bias` holds (token id, bias) pairs; ids below the vocabulary size are checked when the
    request is added, where the vocabulary is known.
    """

    # None: as many as the context (and the KV cache) leaves once the prompt is known (OpenAI's chat).
    max_new_tokens: int | None = 20
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    penalty_counts: PenaltyCounts = "output"
    logit_bias: tuple[tuple[int, float], ...] = ()
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
    regex: str | None = None
    # A grammar in llguidance's Lark dialect (the OpenAI routes' tool calls); not on the TGI wire.
    lark_grammar: str | None = None
    # The OpenAI chat route's tools; the engine turns them into `lark_grammar` once it knows the
    # chat template, and stop sequences then apply to the reply's free text only.
    tool_calling: ToolCalling | None = None
    top_logprobs: int = 0
    apply_chat_template: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.logit_bias, (list, tuple)):
            pairs = tuple(tuple(entry) if isinstance(entry, list) else entry for entry in self.logit_bias)
            object.__setattr__(self, "logit_bias", pairs)
        if self.max_new_tokens is not None:
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
        self._check_additive_penalties()
        _check_logit_bias(self.logit_bias)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if self.truncate is not None:
            _check_int("truncate", self.truncate, minimum=1)
        _check_int("top_logprobs", self.top_logprobs, minimum=0, maximum=MAX_TOP_LOGPROBS)
        self._check_regex()
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValidationError("stop", "every stop sequence must be a non-empty string")
        if self.best_of > 1 and not self.is_sampling:
            raise ValidationError("best_of", "best_of > 1 needs sampling (do_sample or a sampling parameter)")

    def _check_additive_penalties(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if value is not None:
                _check_float(name, value, "must be in [-2, 2]", lambda v: -2 <= v <= 2)
        if self.penalty_counts not in PENALTY_COUNTS:
            raise ValidationError("penalty_counts", f"must be one of {', '.join(PENALTY_COUNTS)}")

    def _check_regex(self) -> None:
        if self.lark_grammar is not None and (self.schema is not None or self.regex is not None):
            raise ValidationError("lark_grammar", "give one of a schema, a regex or a Lark grammar")
        if self.tool_calling is not None and (self.schema is not None or self.regex is not None):
            raise ValidationError("tool_calling", "cannot be combined with a schema or a regex")
        if self.regex is None:
            return
        if not isinstance(self.regex, str):
            raise ValidationError("regex", "must be a string")
        if self.schema is not None:
            raise ValidationError("regex", "give either a schema or a regex, not both")

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


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(name, "must be an integer")
    if value < minimum:
        raise ValidationError(name, f"must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValidationError(name, f"must be <= {maximum}")


def _check_logit_bias(entries: object) -> None:
    """(token id >= 0, finite bias in [-100, 100]) pairs, each id once, at most 300 (OpenAI's rules)."""
    if not isinstance(entries, tuple):
        raise ValidationError("logit_bias", "must be a list of (token id, bias) pairs")
    if len(entries) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValidationError("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    for entry in entries:
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise ValidationError("logit_bias", "every entry must be a (token id, bias) pair")
        _check_int("logit_bias", entry[0], minimum=0)
        _check_float("logit_bias", entry[1], "a bias must be in [-100, 100]", lambda v: -100 <= v <= 100)
    if len({token_id for token_id, _ in entries}) != len(entries):
        raise ValidationError("logit_bias", "a token id may appear once only")


def _check_float(name: str, value: object, rule: str, is_valid) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(name, "must be a number")
    if not math.isfinite(value) or not is_valid(value):
        raise ValidationError(name, rule)


@dataclass(frozen=True, slots=True)
class CacheScope:
    """Whose cached prompt blocks a request may reuse (lora_runtime/prefix_cache.py): only those
    computed for the same `tenant` ("" for the library's one caller) and the same `salt`. The salt
    (the wire's `cache_salt`) is a secret of the caller's choosing that keeps its requests apart from
    every request without it; it is left out of `repr`, so that no log shows it."""

    tenant: str = ""
    salt: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.salt is None:
            return
        if not isinstance(self.salt, str) or not 1 <= len(self.salt) <= MAX_CACHE_SALT_CHARS:
            # The value is never quoted: it is a secret.
            raise ValidationError("cache_salt", f"must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters")


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
class TopToken:
    """One of the most likely tokens at a position (`top_logprobs`): its id, its own text, its logprob
    and whether it is special."""

    id: int
    text: str
    logprob: float
    special: bool


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """One generated token: its id, its text piece, its logprob and whether it is special; `top` holds
    the `top_logprobs` most likely tokens of its step, most likely first."""

    id: int
    text: str
    logprob: float
    special: bool
    top: tuple[TopToken, ...] = ()


@dataclass(frozen=True, slots=True)
class PrefillToken:
    """One prompt token with the logprob the model gave it; the first has none (and no `top`)."""

    id: int
    text: str
    logprob: float | None
    top: tuple[TopToken, ...] = ()


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
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # The format the reply's tool calls are written in (`lora_runtime.sampling.tools`), resolved
    # from the chat template that rendered the request; None when the reply holds no calls.
    tool_call_format: str | None = None


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
    cache_scope: CacheScope = CacheScope()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    arrival_order: int = 0
    # Prefix caching (lora_runtime/prefix_cache.py): the root of the block chain, set when first
    # needed; the hashes of the full blocks so far; the prompt tokens the first admission found cached.
    kv_identity: bytes | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
