"""Per-request sampling state and the batched sampler.

A `SamplingState` is made once per request (per best_of candidate) when it is admitted: it compiles
the request's schema (so a bad schema is a 422 before generation), draws or takes the seed, and owns
the request's CPU generator, its token history and its grammar matcher. `Sampler.sample` turns one
row of logits per request into one token per request. A sampled token depends only on the request's
own logits and its own generator, never on the batch: each row draws from its own generator with
`torch.multinomial` on CPU, which is also what transformers' `generate` does with the global
generator, so `torch.manual_seed(s)` + `generate(do_sample=True)` is the oracle for seed `s`.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import kernels
from lora_runtime.core import SamplingParams
from lora_runtime.sampling.processors import RowSettings, apply_logits_chain
from lora_runtime.sampling.schema import SchemaCompiler, SchemaMatcher

_SEED_MODULUS = 2**64  # torch generators take unsigned 64-bit seeds


class TokenizerInfo:
    """What sampling needs to know about the model's tokenizer; one shared instance per tokenizer.

    `vocab_size` is the width of the logits (it may exceed the tokenizer's own size). The schema
    compiler is built on first use, since wrapping the tokenizer for llguidance costs about a second.
    """

    __slots__ = ("tokenizer", "vocab_size", "eos_token_ids", "_schema_compiler")

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        assert eos_token_ids, "a model needs at least one EOS id"
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._schema_compiler: SchemaCompiler | None = None

    @property
    def schema_compiler(self) -> SchemaCompiler:
        if self._schema_compiler is None:
            self._schema_compiler = SchemaCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        return self._schema_compiler


class SamplingState:
    """Everything one request (one best_of candidate) carries from step to step for sampling."""

    __slots__ = ("params", "seed", "generator", "token_ids", "_last_token_id", "_seen_ids", "_penalty_ids", "_schema")

    def __init__(self, params: SamplingParams, prompt_token_ids: Sequence[int], info: TokenizerInfo) -> None:
        """Raises ValidationError("schema", ...) when the schema cannot be compiled. Each best_of
        candidate draws its own seed (a seed is refused with best_of > 1, docs/semantics.md)."""
        assert prompt_token_ids, "the watermark and the penalty need at least one prompt token"
        self.params = params
        self.seed = _pick_seed(params)
        self.generator = None if self.seed is None else torch.Generator(device="cpu").manual_seed(self.seed)
        self.token_ids: list[int] = []  # generated so far
        self._last_token_id = prompt_token_ids[-1]
        self._seen_ids = set(prompt_token_ids)
        self._penalty_ids = torch.tensor(sorted(self._seen_ids), dtype=torch.int64)
        self._schema = _new_schema_matcher(params.schema, info)

    @property
    def is_sampling(self) -> bool:
        return self.generator is not None

    @property
    def is_schema_complete(self) -> bool:
        return self._schema is not None and self._schema.is_complete

    def row_settings(self) -> RowSettings:
        """This step's logits processing for the request's row."""
        params = self.params
        penalty = params.repetition_penalty if params.repetition_penalty not in (None, 1.0) else None
        sampling = self.is_sampling
        return RowSettings(
            watermark_previous_token_id=self._last_token_id if params.watermark else None,
            repetition_penalty=penalty,
            penalty_token_ids=self._penalty_ids if penalty is not None else None,
            allowed_tokens=self._schema.allowed_tokens() if self._schema is not None else None,
            temperature=params.temperature if sampling else None,
            top_k=params.top_k if sampling else None,
            top_p=params.top_p if sampling else None,
            typical_p=params.typical_p if sampling else None,
        )

    def accept(self, token_id: int) -> None:
        """Record the token the engine appended to this request (normally the sampled one)."""
        self.token_ids.append(token_id)
        self._last_token_id = token_id
        if token_id not in self._seen_ids:
            self._seen_ids.add(token_id)
            self._penalty_ids = torch.cat([self._penalty_ids, torch.tensor([token_id])])
        if self._schema is not None and not self._schema.is_complete:
            self._schema.accept(token_id)


@dataclass(frozen=True, slots=True)
class SampleResult:
    """One token per row, and the log-softmax of the final processed scores at that token."""

    token_ids: list[int]  # [num_rows]
    logprobs: list[float]  # [num_rows]


class Sampler:
    """Chooses the next token of every row of a batch; stateless, all state is in SamplingState."""

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SampleResult:
        """`logits` [num_rows, vocab] (any float dtype, any device), row i belongs to `states[i]`.

        Does not call `accept`: the engine does, once it keeps the token.
        """
        settings = [state.row_settings() for state in states]
        scores = apply_logits_chain(logits, settings)
        # Greedy for every row (sampled rows are replaced below), and the log-softmax normaliser of
        # each row for the chosen token's logprob, both in float32.
        _, token_ids, log_normaliser = kernels.backend_for(scores.device).max_logsumexp(scores)
        sampled_rows = [i for i, state in enumerate(states) if state.is_sampling]
        if sampled_rows:
            token_ids = token_ids.cpu()
            probs = torch.softmax(scores[sampled_rows].float(), dim=-1).cpu()  # [num_sampled, vocab]
            for row, row_probs in zip(sampled_rows, probs):
                token_ids[row] = torch.multinomial(row_probs, 1, generator=states[row].generator)[0]
        chosen = scores.gather(1, token_ids.to(scores.device)[:, None])[:, 0].float() - log_normaliser
        return SampleResult(token_ids=token_ids.tolist(), logprobs=chosen.tolist())


def prompt_logprobs(logits: torch.Tensor, token_ids: Sequence[int]) -> list[float | None]:
    """decoder_input_details: token t's logprob is the log-softmax of `logits` [T, vocab] at t-1;
    the first token has none."""
    assert logits.shape[0] == len(token_ids), "one row of logits per prompt token"
    return [None, *next_token_logprobs(logits[:-1], token_ids[1:])]


def next_token_logprobs(logits: torch.Tensor, next_token_ids: Sequence[int]) -> list[float]:
    """log-softmax of `logits` [N, vocab] row i at `next_token_ids[i]`: the piece of
    `prompt_logprobs` one prefill chunk contributes (its logits, and the ids one position later)."""
    assert logits.shape[0] == len(next_token_ids), "one row of logits per next token"
    if not next_token_ids:
        return []
    targets = torch.tensor(list(next_token_ids), device=logits.device)[:, None]  # [N, 1]
    return torch.log_softmax(logits.float(), dim=-1).gather(1, targets)[:, 0].tolist()


def _pick_seed(params: SamplingParams) -> int | None:
    """The request's seed, a fresh random one, or None when greedy."""
    if not params.is_sampling:
        return None
    if params.seed is None:
        return random.SystemRandom().getrandbits(63)  # 63 bits: fits a signed 64-bit client integer
    return params.seed % _SEED_MODULUS


def _new_schema_matcher(schema: str | None, info: TokenizerInfo) -> SchemaMatcher | None:
    if schema is None:
        return None
    compiler = info.schema_compiler
    return compiler.new_matcher(compiler.compile(schema))
