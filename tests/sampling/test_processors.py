"""Each logits processor against transformers' own, row by row, on random logits; then the chain."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    WatermarkLogitsProcessor,
)

from lora_runtime.sampling.processors import (
    RowSettings,
    apply_frequency_presence_penalty,
    apply_logit_bias,
    apply_logits_chain,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    apply_typical_p,
)

VOCAB = 1000
NUM_ROWS = 7


def _logits() -> torch.Tensor:
    return torch.randn(NUM_ROWS, VOCAB) * 3  # [num_rows, vocab]


def _assert_rows_match(ours: torch.Tensor, logits: torch.Tensor, oracle_for_row) -> None:
    for i in range(logits.shape[0]):
        expected = oracle_for_row(i)(None, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], expected, rtol=1e-5, atol=1e-5)


def test_temperature_matches_transformers() -> None:
    logits = _logits()
    temperatures = [0.1, 0.5, 0.7, 1.3, 2.0, 0.05, 10.0]
    ours = apply_temperature(logits, temperatures)
    _assert_rows_match(ours, logits, lambda i: TemperatureLogitsWarper(temperatures[i]))


def test_top_k_matches_transformers_including_ties() -> None:
    logits = _logits()
    logits[0, :10] = 50.0  # ten-way tie at the top: top_k 3 keeps all ten
    top_k = [3, 1, 5, 50, 999, 1000, 2000]
    ours = apply_top_k(logits, top_k)
    _assert_rows_match(ours, logits, lambda i: TopKLogitsWarper(top_k[i]))
    assert torch.isfinite(ours[0]).sum() == 10


def test_top_p_matches_transformers() -> None:
    logits = _logits()
    top_p = [0.1, 0.5, 0.9, 0.95, 0.99, 0.01, 0.7]
    ours = apply_top_p(logits, top_p)
    _assert_rows_match(ours, logits, lambda i: TopPLogitsWarper(top_p[i]))
    assert (torch.isfinite(ours).sum(dim=1) >= 1).all()


def test_typical_p_matches_transformers() -> None:
    logits = _logits()
    typical_p = [0.2, 0.5, 0.9, 0.95, 0.99, 0.01, 0.7]
    ours = apply_typical_p(logits, typical_p)
    _assert_rows_match(ours, logits, lambda i: TypicalLogitsWarper(typical_p[i]))


def test_repetition_penalty_matches_transformers_over_repeated_ids() -> None:
    logits = _logits()
    histories = [torch.randint(0, VOCAB, (n,)) for n in (1, 5, 40, 300, 2, 17, 9)]
    penalties = [1.2, 0.8, 1.5, 2.0, 1.01, 3.0, 0.5]
    distinct = [torch.unique(h) for h in histories]
    ours = apply_repetition_penalty(logits, distinct, penalties)
    for i, history in enumerate(histories):
        expected = RepetitionPenaltyLogitsProcessor(penalties[i])(history[None], logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], expected, rtol=1e-5, atol=1e-5)


def _penalised(logits: torch.Tensor, counts: torch.Tensor, frequency: float, presence: float) -> torch.Tensor:
    """vLLM's formula over dense counts: logits [vocab], counts [vocab] (c[t], 0 when absent)."""
    return logits - frequency * counts - presence * (counts > 0).float()


def test_frequency_presence_penalty_matches_the_formula_over_explicit_counts() -> None:
    logits = _logits()
    histories = [torch.randint(0, VOCAB, (n,)) for n in (1, 5, 40, 300, 2, 17, 9)]
    frequency = [0.5, -0.5, 2.0, 1.0, 0.0, -2.0, 0.3]
    presence = [0.0, 1.0, -1.5, 0.7, 2.0, 0.5, -0.2]
    distinct = [torch.unique(h, return_counts=True) for h in histories]
    ours = apply_frequency_presence_penalty(
        logits, [ids for ids, _ in distinct], [c.float() for _, c in distinct], frequency, presence
    )
    for i, history in enumerate(histories):
        counts = torch.bincount(history, minlength=VOCAB).float()
        expected = _penalised(logits[i], counts, frequency[i], presence[i])
        torch.testing.assert_close(ours[i], expected, rtol=1e-5, atol=1e-5)


def test_frequency_presence_penalty_by_hand() -> None:
    # Generated [2, 2, 1]: c = [0, 1, 2, 0]. With frequency 0.5 and presence 0.3, vLLM's
    # logits -= 0.5 * c + 0.3 * (c > 0) gives token 1: 2.0 - 0.5 - 0.3, token 2: 3.0 - 1.0 - 0.3.
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [1.0, 2.0, 3.0, 0.5]])
    ids, counts = torch.tensor([2, 1]), torch.tensor([2.0, 1.0])
    ours = apply_frequency_presence_penalty(logits, [ids, ids], [counts, counts], [0.5, -1.0], [0.3, 0.0])
    torch.testing.assert_close(ours, torch.tensor([[1.0, 1.2, 1.7, 0.5], [1.0, 3.0, 5.0, 0.5]]))


def test_logit_bias_matches_transformers_sequence_bias() -> None:
    logits = _logits()
    generator = torch.Generator().manual_seed(3)
    biases = [
        {int(t): float(b) for t, b in zip(torch.randperm(VOCAB, generator=generator)[:n],
                                          torch.empty(n).uniform_(-100, 100, generator=generator))}
        for n in (1, 3, 300, 10, 2, 50, 7)
    ]
    ours = apply_logit_bias(
        logits,
        [torch.tensor(list(b)) for b in biases],
        [torch.tensor(list(b.values()), dtype=torch.float32) for b in biases],
    )
    for i, bias in enumerate(biases):
        expected = _sequence_bias(bias, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], expected, rtol=1e-5, atol=1e-5)


def _sequence_bias(bias: dict[int, float], scores: torch.Tensor) -> torch.Tensor:
    """transformers' SequenceBiasLogitsProcessor with single-token sequences, on scores [1, vocab]."""
    processor = SequenceBiasLogitsProcessor([[[token_id], value] for token_id, value in bias.items()])
    return processor(torch.tensor([[0]]), scores)


def test_watermark_row_matches_transformers() -> None:
    logits = _logits()
    previous = [0, 1, 7, 999, 123, 4242 % VOCAB, 55]
    rows = [RowSettings(watermark_previous_token_id=p) for p in previous]
    ours = apply_logits_chain(logits, rows)
    oracle = WatermarkLogitsProcessor(VOCAB, "cpu", greenlist_ratio=0.5, bias=2.0, hashing_key=15485863)
    for i, prev in enumerate(previous):
        expected = oracle(torch.tensor([[3, prev]]), logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], expected, rtol=1e-6, atol=1e-6)
    assert torch.isclose(ours - logits, torch.tensor(2.0)).sum(dim=1).tolist() == [VOCAB // 2] * NUM_ROWS


def _oracle_chain(row: RowSettings, history: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """transformers' processors (and the penalty formula) one after another in our order, for one row
    [1, vocab]."""
    scores = logits.clone()
    if row.watermark_previous_token_id is not None:
        watermark = WatermarkLogitsProcessor(VOCAB, "cpu", greenlist_ratio=0.5, bias=2.0)
        scores = watermark(torch.tensor([[row.watermark_previous_token_id]]), scores)
    if row.repetition_penalty is not None:
        scores = RepetitionPenaltyLogitsProcessor(row.repetition_penalty)(history[None], scores)
    if row.counted_token_ids is not None:
        counts = torch.zeros(VOCAB).index_put((row.counted_token_ids,), row.token_counts)
        scores = _penalised(scores[0], counts, row.frequency_penalty, row.presence_penalty)[None]
    if row.logit_bias_token_ids is not None:
        bias = dict(zip(row.logit_bias_token_ids.tolist(), row.logit_bias_values.tolist()))
        scores = _sequence_bias(bias, scores)
    if row.allowed_tokens is not None:
        scores = scores.masked_fill(~row.allowed_tokens, float("-inf"))
    warpers = [
        (row.temperature, TemperatureLogitsWarper, lambda v: v != 1.0),
        (row.top_k, TopKLogitsWarper, lambda v: v > 0),
        (row.top_p, TopPLogitsWarper, lambda v: v < 1.0),
        (row.typical_p, TypicalLogitsWarper, lambda v: v < 1.0),
    ]
    for value, warper, is_active in warpers:
        if value is not None and is_active(value):
            scores = warper(value)(None, scores)
    return scores


def _counted(history: torch.Tensor) -> dict[str, torch.Tensor]:
    ids, counts = torch.unique(history, return_counts=True)
    return dict(counted_token_ids=ids, token_counts=counts.float())


def _biased(token_ids: list[int], values: list[float]) -> dict[str, torch.Tensor]:
    return dict(logit_bias_token_ids=torch.tensor(token_ids), logit_bias_values=torch.tensor(values))


@pytest.mark.parametrize("num_rows", [1, 3, 7, 9])
def test_chain_in_order_matches_transformers(num_rows: int) -> None:
    logits = torch.randn(num_rows, VOCAB) * 3
    histories = [torch.randint(0, VOCAB, (20,)) for _ in range(9)]
    histories[7] = torch.randint(0, 50, (40,))  # ids that repeat: counts above 1
    allowed = torch.rand(VOCAB) < 0.3
    allowed[:50] = True
    settings = [
        RowSettings(watermark_previous_token_id=5, repetition_penalty=1.3, penalty_token_ids=torch.unique(histories[0]),
                    frequency_penalty=1.5, presence_penalty=-0.5, **_counted(histories[0]),
                    **_biased([1, 2, 3], [5.0, -5.0, 100.0]), temperature=0.7, top_k=40, top_p=0.9, typical_p=0.95),
        RowSettings(),
        RowSettings(allowed_tokens=allowed, temperature=1.5, top_p=0.8, **_biased([7], [-3.0])),
        RowSettings(repetition_penalty=0.7, penalty_token_ids=torch.unique(histories[3]), top_k=5),
        RowSettings(temperature=1.0, top_p=1.0, typical_p=1.0, top_k=0),
        RowSettings(watermark_previous_token_id=999, allowed_tokens=allowed, typical_p=0.5),
        RowSettings(temperature=0.3),
        # The repetition penalty, then the additive ones, then the mask, then temperature: each order
        # gives other values here.
        RowSettings(repetition_penalty=2.0, penalty_token_ids=torch.unique(histories[7]), frequency_penalty=1.0,
                    presence_penalty=-0.5, **_counted(histories[7]), **_biased([1, 2, 3, 60], [9.0, -9.0, 0.5, 4.0]),
                    allowed_tokens=allowed, temperature=2.0),
        RowSettings(frequency_penalty=0.0, presence_penalty=1.0, **_counted(histories[8])),
    ][:num_rows]
    ours = apply_logits_chain(logits, settings)
    for i, row in enumerate(settings):
        expected = _oracle_chain(row, histories[i], logits[i : i + 1])
        torch.testing.assert_close(ours[i : i + 1], expected, rtol=1e-5, atol=1e-5)


def test_identity_rows_cost_nothing() -> None:
    logits = _logits()
    assert apply_logits_chain(logits, [RowSettings()] * NUM_ROWS) is logits
    before = logits.clone()
    out = apply_logits_chain(logits, [RowSettings(temperature=0.5)] + [RowSettings()] * (NUM_ROWS - 1))
    torch.testing.assert_close(logits, before)  # the input is never modified
    torch.testing.assert_close(out[1:], before[1:], rtol=0, atol=0)
