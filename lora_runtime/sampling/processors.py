"""The logits chain, batched over rows that each carry their own parameters.

Order (docs/semantics.md): watermark, repetition penalty, frequency/presence penalty, logit_bias,
schema/regex mask, temperature, top_k, top_p, typical_p: TGI's order, with the additive steps after
the repetition penalty as TGI places its frequency penalty. Each step is one vectorised call over
the rows that need it (per-row parameter tensors); rows that need nothing are never touched, so an
all-greedy batch with no penalties costs only the Python loop that finds out there is nothing to do.

Every warper reproduces the arithmetic of the transformers processor of the same name for one row,
so those processors are the oracles (tests/sampling/test_processors.py); the frequency/presence
penalty has no transformers twin, its oracle is vLLM's formula written out in the test.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lora_runtime.sampling.watermark import (
    WATERMARK_DELTA,
    WATERMARK_GAMMA,
    add_watermark_bias,
)

FILTERED = float("-inf")


@dataclass(frozen=True, slots=True)
class RowSettings:
    """What the chain does to one row this step; the neutral values leave the row untouched.

    The warper fields (temperature .. typical_p) are only set for rows that sample: a greedy row's
    argmax does not depend on them. `counted_token_ids` is set, with both additive penalties (0 for
    one not asked), only when some token has a count.
    """

    watermark_previous_token_id: int | None = None
    repetition_penalty: float | None = None
    penalty_token_ids: torch.Tensor | None = None  # [num_distinct_ids] int64, CPU
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    counted_token_ids: torch.Tensor | None = None  # [num_counted] int64, CPU; distinct ids
    token_counts: torch.Tensor | None = None  # [num_counted] float32, CPU; c[t] > 0 of each counted id
    logit_bias_token_ids: torch.Tensor | None = None  # [num_biased] int64, CPU; distinct ids
    logit_bias_values: torch.Tensor | None = None  # [num_biased] float32, CPU
    allowed_tokens: torch.Tensor | None = None  # [vocab] bool, CPU; False = masked out
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None

    @property
    def is_identity(self) -> bool:
        return (
            self.watermark_previous_token_id is None
            and self.repetition_penalty is None
            and self.counted_token_ids is None
            and self.logit_bias_token_ids is None
            and self.allowed_tokens is None
            and self.temperature is None
            and self.top_k is None
            and self.top_p is None
            and self.typical_p is None
        )


def apply_logits_chain(scores: torch.Tensor, rows: Sequence[RowSettings]) -> torch.Tensor:
    """Process `scores` [num_rows, vocab] (any float dtype) row by row with `rows[i]`; returns a new
    float32 tensor.

    Returns `scores` itself (not a copy, in its own dtype) when every row is the identity: the
    greedy reductions widen bf16 rows themselves, so the model's logits need no float32 copy.
    """
    assert scores.dim() == 2 and scores.shape[0] == len(rows), "one RowSettings per row"
    if all(row.is_identity for row in rows):
        return scores
    scores = scores.to(torch.float32, copy=True)
    _watermark_rows(scores, rows)
    _penalty_rows(scores, rows)
    _additive_penalty_rows(scores, rows)
    _logit_bias_rows(scores, rows)
    _mask_rows(scores, rows)
    _warp_rows(scores, rows, "temperature", lambda v: v != 1.0, apply_temperature)
    _warp_rows(scores, rows, "top_k", lambda v: v > 0, apply_top_k)
    _warp_rows(scores, rows, "top_p", lambda v: v < 1.0, apply_top_p)
    _warp_rows(scores, rows, "typical_p", lambda v: v < 1.0, apply_typical_p)
    return scores


def apply_repetition_penalty(
    scores: torch.Tensor, token_ids: Sequence[torch.Tensor], penalties: Sequence[float]
) -> torch.Tensor:
    """Penalise, in row i, the ids in `token_ids[i]`: divide a positive logit by the penalty,
    multiply a negative one. `scores` [num_rows, vocab]; ids outside the vocab are ignored."""
    vocab_size = scores.shape[1]
    row_idx = torch.cat([torch.full((len(ids),), i) for i, ids in enumerate(token_ids)])
    flat_ids = torch.cat(list(token_ids))
    inside = flat_ids < vocab_size
    seen = torch.zeros(scores.shape, dtype=torch.bool)
    seen[row_idx[inside], flat_ids[inside]] = True
    penalty = torch.tensor(penalties, dtype=scores.dtype, device=scores.device)[:, None]  # [num_rows, 1]
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen.to(scores.device), penalised, scores)


def apply_frequency_presence_penalty(
    scores: torch.Tensor,
    token_ids: Sequence[torch.Tensor],
    counts: Sequence[torch.Tensor],
    frequency: Sequence[float],
    presence: Sequence[float],
) -> torch.Tensor:
    """Row i: scores[i, t] -= frequency[i] * c + presence[i] * (c > 0), where c = counts[i][j] for
    t = token_ids[i][j] (distinct ids); tokens not listed have c = 0. `scores` [num_rows, vocab]."""
    row_idx = _entry_rows(token_ids)
    flat_counts = torch.cat(list(counts)).to(scores.dtype)
    frequency_of_entry = torch.tensor(frequency, dtype=scores.dtype)[row_idx]
    presence_of_entry = torch.tensor(presence, dtype=scores.dtype)[row_idx]
    penalty = frequency_of_entry * flat_counts + presence_of_entry * (flat_counts > 0)
    return _add_at(scores, row_idx, torch.cat(list(token_ids)), -penalty)


def apply_logit_bias(
    scores: torch.Tensor, token_ids: Sequence[torch.Tensor], biases: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Row i: scores[i, token_ids[i][j]] += biases[i][j] (distinct ids). `scores` [num_rows, vocab]."""
    flat_biases = torch.cat(list(biases)).to(scores.dtype)
    return _add_at(scores, _entry_rows(token_ids), torch.cat(list(token_ids)), flat_biases)


# Below this a temperature only sharpens the distribution to its argmax, but dividing by it can
# overflow fp32 logits to inf (and NaN probabilities): the limit T -> 0 is greedy, and at 1e-4 a
# logit gap of 0.01 already gives a ratio of e^100.
MIN_TEMPERATURE = 1e-4


def apply_temperature(scores: torch.Tensor, temperatures: Sequence[float]) -> torch.Tensor:
    """Divide row i by `temperatures[i]` (> 0), at least MIN_TEMPERATURE."""
    return scores / _column([max(t, MIN_TEMPERATURE) for t in temperatures], scores)


def apply_top_k(scores: torch.Tensor, top_k: Sequence[int]) -> torch.Tensor:
    """Keep in row i the values >= its `top_k[i]`-th largest (ties may keep more than k)."""
    ks = [min(k, scores.shape[1]) for k in top_k]
    top_values = torch.topk(scores, max(ks)).values  # [num_rows, max_k], descending
    kth_idx = torch.tensor(ks, device=scores.device)[:, None] - 1  # [num_rows, 1]
    kth_value = top_values.gather(1, kth_idx)  # [num_rows, 1]
    return scores.masked_fill(scores < kth_value, FILTERED)


def apply_top_p(scores: torch.Tensor, top_p: Sequence[float]) -> torch.Tensor:
    """Keep in row i the smallest set of most likely tokens whose probability reaches `top_p[i]`."""
    sorted_logits, sorted_idx = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [num_rows, vocab]
    # 1 - p in double then fp32, as the oracle's scalar comparison does.
    remove_sorted = cumulative <= _column([1.0 - p for p in top_p], scores)
    remove_sorted[:, -1] = False  # always keep the most likely token
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    return scores.masked_fill(remove, FILTERED)


def apply_typical_p(scores: torch.Tensor, typical_p: Sequence[float]) -> torch.Tensor:
    """Locally typical sampling: keep in row i the tokens whose surprisal is closest to the row's
    entropy, until their probability mass reaches `typical_p[i]`."""
    log_probs = torch.log_softmax(scores, dim=-1)
    entropy = -(log_probs * log_probs.exp()).nansum(-1, keepdim=True)  # [num_rows, 1]
    shifted = torch.abs(-log_probs - entropy)
    sorted_shifted, sorted_idx = torch.sort(shifted, descending=False)
    cumulative = scores.gather(-1, sorted_idx).softmax(dim=-1).cumsum(dim=-1)
    last_kept = (cumulative < _column(typical_p, scores)).sum(dim=1)
    last_kept.clamp_(max=scores.shape[1] - 1)
    remove_sorted = sorted_shifted > sorted_shifted.gather(1, last_kept[:, None])
    remove_sorted[:, 0] = False  # always keep the most typical token
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    return scores.masked_fill(remove, FILTERED)


def apply_token_mask(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token where `allowed` [num_rows, vocab] is False."""
    return scores.masked_fill(~allowed.to(scores.device), FILTERED)


def _entry_rows(token_ids: Sequence[torch.Tensor]) -> torch.Tensor:
    """The row of each entry of torch.cat(token_ids): [total entries] int64."""
    return torch.cat([torch.full((len(ids),), i) for i, ids in enumerate(token_ids)])


def _add_at(scores: torch.Tensor, row_idx: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A copy of `scores` with values[j] added at (row_idx[j], token_ids[j]); CPU indices and values."""
    index = (row_idx.to(scores.device), token_ids.to(scores.device))
    return scores.index_put(index, values.to(scores.device), accumulate=True)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]  # [num_rows, 1]


def _update_rows(scores: torch.Tensor, row_idx: list[int], fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """scores[row_idx] = fn(scores[row_idx]), skipping the gather when every row takes part."""
    if len(row_idx) == scores.shape[0]:
        scores.copy_(fn(scores))
        return
    index = torch.tensor(row_idx, device=scores.device)
    scores[index] = fn(scores.index_select(0, index))


def _watermark_rows(scores: torch.Tensor, rows: Sequence[RowSettings]) -> None:
    for i, row in enumerate(rows):
        if row.watermark_previous_token_id is not None:
            add_watermark_bias(scores[i], row.watermark_previous_token_id, WATERMARK_GAMMA, WATERMARK_DELTA)


def _penalty_rows(scores: torch.Tensor, rows: Sequence[RowSettings]) -> None:
    def penalize(sub: torch.Tensor, picked: list[RowSettings]) -> torch.Tensor:
        return apply_repetition_penalty(sub, [row.penalty_token_ids for row in picked],
                                        [row.repetition_penalty for row in picked])

    _update_picked_rows(scores, rows, lambda row: row.repetition_penalty not in (None, 1.0), penalize)


def _additive_penalty_rows(scores: torch.Tensor, rows: Sequence[RowSettings]) -> None:
    def penalize(sub: torch.Tensor, picked: list[RowSettings]) -> torch.Tensor:
        return apply_frequency_presence_penalty(
            sub, [row.counted_token_ids for row in picked], [row.token_counts for row in picked],
            [row.frequency_penalty for row in picked], [row.presence_penalty for row in picked])

    _update_picked_rows(scores, rows, lambda row: row.counted_token_ids is not None, penalize)


def _logit_bias_rows(scores: torch.Tensor, rows: Sequence[RowSettings]) -> None:
    def bias(sub: torch.Tensor, picked: list[RowSettings]) -> torch.Tensor:
        return apply_logit_bias(sub, [row.logit_bias_token_ids for row in picked],
                                [row.logit_bias_values for row in picked])

    _update_picked_rows(scores, rows, lambda row: row.logit_bias_token_ids is not None, bias)


def _mask_rows(scores: torch.Tensor, rows: Sequence[RowSettings]) -> None:
    def mask(sub: torch.Tensor, picked: list[RowSettings]) -> torch.Tensor:
        return apply_token_mask(sub, torch.stack([row.allowed_tokens for row in picked]))  # [num_picked, vocab]

    _update_picked_rows(scores, rows, lambda row: row.allowed_tokens is not None, mask)


def _warp_rows(
    scores: torch.Tensor,
    rows: Sequence[RowSettings],
    name: str,
    is_active: Callable[[float], bool],
    warp: Callable[[torch.Tensor, list], torch.Tensor],
) -> None:
    """Apply one warper to the rows whose parameter `name` is set and not neutral."""
    _update_picked_rows(scores, rows, lambda row: (value := getattr(row, name)) is not None and is_active(value),
                        lambda sub, picked: warp(sub, [getattr(row, name) for row in picked]))


def _update_picked_rows(
    scores: torch.Tensor,
    rows: Sequence[RowSettings],
    is_picked: Callable[[RowSettings], bool],
    apply: Callable[[torch.Tensor, list[RowSettings]], torch.Tensor],
) -> None:
    """scores[picked] = apply(scores[picked], the picked rows' settings) over the rows `is_picked`
    accepts; with none, nothing is done (not even a gather)."""
    picked = [i for i, row in enumerate(rows) if is_picked(row)]
    if picked:
        picked_rows = [rows[i] for i in picked]
        _update_rows(scores, picked, lambda sub: apply(sub, picked_rows))
