"""Per-request sampling state and the batched sampler.

A `SamplingState` is made once per request (per best_of candidate) when it is admitted: it compiles
the request's schema or regex and checks its logit_bias ids against the vocabulary (so bad ones are
a 422 before generation), draws or takes the seed, and owns the request's CPU generator, its token
history, its token counts for the frequency/presence penalties and its grammar matcher.
`Sampler.sample` turns one row of logits per request into one token per request. A sampled token
depends only on the request's own logits and its own generator, never on the batch: each row draws
from its own generator with `torch.multinomial` on CPU, which is also what transformers' `generate`
does with the global generator, so `torch.manual_seed(s)` + `generate(do_sample=True)` is the oracle
for seed `s`. The rows that ask for `top_logprobs` also get their most likely tokens; the others pay
nothing for it.
"""
from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import kernels
from lora_runtime.core import SamplingParams
from lora_runtime.detokenizer import TokenTexts
from lora_runtime.errors import ValidationError
from lora_runtime.sampling.processors import RowSettings, apply_logits_chain
from lora_runtime.sampling.schema import SchemaCompiler, SchemaMatcher
from lora_runtime.step_timing import StepTimes

_SEED_MODULUS = 2**64  # torch generators take unsigned 64-bit seeds
_ONE = torch.ones(1)
TopPairs = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


class TokenizerInfo:
    """What sampling needs to know about the model's tokenizer; one shared instance per tokenizer.

    `vocab_size` is the width of the logits (it may exceed the tokenizer's own size). The schema
    compiler is built on first use, since wrapping the tokenizer for llguidance costs about a second.
    """

    __slots__ = ("tokenizer", "token_texts", "vocab_size", "eos_token_ids", "_schema_compiler")

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        assert eos_token_ids, "a model needs at least one EOS id"
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)  # shared by the requests' detokenizers
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

    __slots__ = ("params", "seed", "generator", "token_ids", "_last_token_id", "_seen_ids", "_penalty_ids",
                 "_counts", "_logit_bias", "_grammar")

    def __init__(
        self, params: SamplingParams, prompt_token_ids: Sequence[int], info: TokenizerInfo, candidate_index: int = 0
    ) -> None:
        """Raises ValidationError("schema" / "regex", ...) when the constraint cannot be compiled and
        ValidationError("logit_bias", ...) for an id outside the vocabulary. best_of candidate i draws
        with seed + i when the request has a seed, else with a seed of its own (docs/semantics.md)."""
        assert prompt_token_ids, "the watermark and the penalty need at least one prompt token"
        self.params = params
        self.seed = _pick_seed(params, candidate_index)
        self.generator = None if self.seed is None else torch.Generator(device="cpu").manual_seed(self.seed)
        self.token_ids: list[int] = []  # generated so far
        self._last_token_id = prompt_token_ids[-1]
        self._seen_ids = set(prompt_token_ids)
        self._penalty_ids = torch.tensor(sorted(self._seen_ids), dtype=torch.int64)
        self._counts = _new_token_counts(params, prompt_token_ids)
        self._logit_bias = _logit_bias_tensors(params.logit_bias, info.vocab_size)
        self._grammar = _new_grammar_matcher(params, info)

    @property
    def is_sampling(self) -> bool:
        return self.generator is not None

    @property
    def is_grammar_complete(self) -> bool:
        """The schema's document (or the regex's match) is finished: only EOS may follow."""
        return self._grammar is not None and self._grammar.is_complete

    def row_settings(self) -> RowSettings:
        """This step's logits processing for the request's row."""
        params = self.params
        penalty = params.repetition_penalty if params.repetition_penalty not in (None, 1.0) else None
        sampling = self.is_sampling
        counts = self._penalty_counts()
        bias_ids, bias_values = self._logit_bias or (None, None)
        return RowSettings(
            watermark_previous_token_id=self._last_token_id if params.watermark else None,
            repetition_penalty=penalty,
            penalty_token_ids=self._penalty_ids if penalty is not None else None,
            frequency_penalty=(params.frequency_penalty or 0.0) if counts is not None else None,
            presence_penalty=(params.presence_penalty or 0.0) if counts is not None else None,
            counted_token_ids=self._counts.token_ids if counts is not None else None,
            token_counts=counts,
            logit_bias_token_ids=bias_ids,
            logit_bias_values=bias_values,
            allowed_tokens=self._grammar.allowed_tokens() if self._grammar is not None else None,
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
        if self._counts is not None:
            self._counts.add(token_id)
        if self._grammar is not None and not self._grammar.is_complete:
            self._grammar.accept(token_id)

    def _penalty_counts(self) -> torch.Tensor | None:
        """c[t] of each counted id for the frequency/presence penalties, or None when nothing is
        counted: occurrences among generated tokens ("output"), or among prompt + generated tokens
        divided by their number ("sequence_fraction", TGI's frequency penalty)."""
        counts = self._counts
        if counts is None or counts.num_tokens == 0:
            return None
        if self.params.penalty_counts == "sequence_fraction":
            return counts.counts / counts.num_tokens
        return counts.counts


class TokenCounts:
    """How often each token id occurred, kept incrementally. The tensors are replaced, never written
    in place, so that a RowSettings already built keeps its step's values."""

    __slots__ = ("token_ids", "counts", "num_tokens", "_position")

    def __init__(self, token_ids: Sequence[int]) -> None:
        counter = Counter(token_ids)
        self._position = {token_id: i for i, token_id in enumerate(counter)}
        self.token_ids = torch.tensor(list(counter), dtype=torch.int64)  # [num_distinct]
        self.counts = torch.tensor(list(counter.values()), dtype=torch.float32)  # [num_distinct]
        self.num_tokens = len(token_ids)

    def add(self, token_id: int) -> None:
        self.num_tokens += 1
        position = self._position.get(token_id)
        if position is None:
            self._position[token_id] = len(self._position)
            self.token_ids = torch.cat([self.token_ids, torch.tensor([token_id])])
            self.counts = torch.cat([self.counts, _ONE])
        else:
            self.counts = self.counts.index_add(0, torch.tensor([position]), _ONE)


@dataclass(frozen=True, slots=True)
class SampleResult:
    """One token per row, and the log-softmax of the final processed scores at that token; `top`
    holds each row's `top_logprobs` most likely tokens under the same log-softmax (() when not asked)."""

    token_ids: list[int]  # [num_rows]
    logprobs: list[float]  # [num_rows]
    top: list[TopPairs]  # [num_rows]
    # [num_rows]: False where the row's scores were NaN or infinite (its token and logprob mean nothing)
    finite: list[bool]


class Sampler:
    """Chooses the next token of every row of a batch; stateless, all state is in SamplingState.
    `step_times`, when given, gets the time of the vocabulary-wide reduction, which runs on every
    compute thread, as its own phase."""

    def __init__(self, step_times: StepTimes | None = None) -> None:
        self._step_times = step_times

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SampleResult:
        """`logits` [num_rows, vocab] (any float dtype, any device), row i belongs to `states[i]`.

        Does not call `accept`: the engine does, once it keeps the token.
        """
        settings = [state.row_settings() for state in states]
        scores = apply_logits_chain(logits, settings)
        # Greedy for every row (sampled rows are replaced below), and the log-softmax normaliser of
        # each row for the chosen token's logprob, both in float32.
        with self._phase("sample_reduce"):
            _, token_ids, log_normaliser = kernels.backend_for(scores.device).max_logsumexp(scores)
        # A row holding a NaN or +inf (or nothing but -inf) has no finite normaliser: its token is
        # meaningless (the greedy index may even lie past the vocabulary), so it draws token 0 instead
        # of failing the batch with torch's text, and the engine fails that request alone by `finite`.
        finite = torch.isfinite(log_normaliser)  # [num_rows]
        token_ids = torch.where(finite, token_ids, 0)
        sampled_rows = [i for i, state in enumerate(states) if state.is_sampling]
        if sampled_rows:
            token_ids = token_ids.cpu()
            probs = torch.softmax(scores[sampled_rows].float(), dim=-1).cpu()  # [num_sampled, vocab]
            for row, row_probs, row_finite in zip(sampled_rows, probs, finite[sampled_rows].tolist()):
                if row_finite:
                    token_ids[row] = torch.multinomial(row_probs, 1, generator=states[row].generator)[0]
        chosen = scores.gather(1, token_ids.to(scores.device)[:, None])[:, 0].float() - log_normaliser
        top = _top_of_rows(scores, log_normaliser, [state.params.top_logprobs for state in states])
        token_list, logprob_list, finite_list = _read_rows(token_ids, chosen, finite)
        return SampleResult(token_ids=token_list, logprobs=logprob_list, top=top, finite=finite_list)

    def _phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self._step_times.phase(name) if self._step_times is not None else contextlib.nullcontext()


def _read_rows(token_ids: torch.Tensor, logprobs: torch.Tensor,
               finite: torch.Tensor) -> tuple[list[int], list[float], list[bool]]:
    """token_ids [num_rows], logprobs [num_rows] float32 and finite [num_rows] bool to the host in
    one read: on a GPU each read waits for the device, and this is the one read a greedy step needs.
    All fit float64 exactly (ids < 2**53, float32 values, 0 and 1)."""
    device = logprobs.device
    ids, values, flags = torch.stack(
        [token_ids.to(device, torch.float64), logprobs.double(), finite.to(device, torch.float64)]).tolist()
    return [int(token_id) for token_id in ids], values, [flag == 1.0 for flag in flags]


def _top_of_rows(scores: torch.Tensor, log_normaliser: torch.Tensor, counts: Sequence[int]) -> list[TopPairs]:
    """`top_tokens` of the log-softmax of the rows of `scores` [num_rows, vocab] whose count is > 0,
    row i cut to its own counts[i]; () for the other rows, which cost nothing."""
    top: list[TopPairs] = [()] * len(counts)
    picked = [i for i, n in enumerate(counts) if n > 0]
    if not picked:
        return top
    index = torch.tensor(picked, device=scores.device)
    normaliser = log_normaliser.to(scores.device).index_select(0, index)[:, None]  # [num_picked, 1]
    logprobs = scores.index_select(0, index).float() - normaliser
    for row, pairs in zip(picked, top_tokens(logprobs, max(counts[i] for i in picked))):
        top[row] = pairs[: counts[row]]
    return top


def top_tokens(logprobs: torch.Tensor, n: int) -> list[TopPairs]:
    """The n largest entries of each row of `logprobs` [num_rows, vocab] as (id, logprob) pairs, most
    likely first, ties to the lower id (exactly n, never more on ties). Entries of -inf, tokens that
    the processing ruled out, are left out, so a row may return fewer when fewer are possible."""
    n = min(n, logprobs.shape[1])
    nth = torch.topk(logprobs, n).values[:, -1:]  # [num_rows, 1]
    above, tied = logprobs > nth, logprobs == nth  # [num_rows, vocab]
    # Of the entries equal to the n-th largest, the lowest ids complete the n.
    keep = above | (tied & (tied.cumsum(dim=1) <= n - above.sum(dim=1, keepdim=True)))
    token_ids = keep.nonzero()[:, 1].view(-1, n)  # [num_rows, n], ascending ids in each row
    values = logprobs.gather(1, token_ids)
    order = torch.sort(values, dim=1, descending=True, stable=True).indices  # stable: lower ids stay first
    token_ids, values = token_ids.gather(1, order).tolist(), values.gather(1, order).tolist()
    return [
        tuple((token_id, value) for token_id, value in zip(row_ids, row_values) if value != float("-inf"))
        for row_ids, row_values in zip(token_ids, values)
    ]


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
    return chunk_logprobs(logits, next_token_ids, num_top=0)[0]


def chunk_logprobs(logits: torch.Tensor, next_token_ids: Sequence[int],
                   num_top: int) -> tuple[list[float], list[TopPairs] | None]:
    """One prefill chunk's piece of the prompt's logprobs (`decoder_input_details`): row i of
    `logits` [N, vocab] log-softmaxed at `next_token_ids[i]`, and each row's `num_top` most likely
    tokens (None when 0)."""
    rows = torch.log_softmax(logits.float(), dim=-1)  # [N, vocab]
    targets = torch.tensor(list(next_token_ids), device=rows.device)[:, None]  # [N, 1]
    values = rows.gather(1, targets)[:, 0].tolist()
    return values, top_tokens(rows, num_top) if num_top > 0 else None


def _pick_seed(params: SamplingParams, candidate_index: int) -> int | None:
    """The request's seed (plus the best_of candidate's index), a fresh random one, or None when greedy."""
    if not params.is_sampling:
        return None
    if params.seed is None:
        return random.SystemRandom().getrandbits(63)  # 63 bits: fits a signed 64-bit client integer
    return (params.seed + candidate_index) % _SEED_MODULUS


def _new_token_counts(params: SamplingParams, prompt_token_ids: Sequence[int]) -> TokenCounts | None:
    """Counts for the frequency/presence penalties, kept only when one of them is asked for."""
    if not params.frequency_penalty and not params.presence_penalty:
        return None
    return TokenCounts(prompt_token_ids if params.penalty_counts == "sequence_fraction" else ())


def _logit_bias_tensors(
    logit_bias: Sequence[tuple[int, float]], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids [num_biased] int64, biases [num_biased] float32), or None without a bias."""
    if not logit_bias:
        return None
    outside = [token_id for token_id, _ in logit_bias if token_id >= vocab_size]
    if outside:
        raise ValidationError("logit_bias", f"token id {outside[0]} is not below the vocabulary size {vocab_size}")
    token_ids, biases = zip(*logit_bias)
    return torch.tensor(token_ids, dtype=torch.int64), torch.tensor(biases, dtype=torch.float32)


def _new_grammar_matcher(params: SamplingParams, info: TokenizerInfo) -> SchemaMatcher | None:
    """The matcher of the request's schema, regex or grammar (at most one: SamplingParams checks)."""
    if params.schema is None and params.regex is None and params.lark_grammar is None:
        return None
    compiler = info.schema_compiler  # built on first use (~1 s)
    if params.schema is not None:
        return compiler.new_matcher(compiler.compile(params.schema))
    if params.regex is not None:
        return compiler.new_matcher(compiler.compile_regex(params.regex))
    return compiler.new_matcher(compiler.compile_lark(params.lark_grammar))
