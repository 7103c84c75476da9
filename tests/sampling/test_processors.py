"""Each logits processor against transformers' own, row by row, on random logits; then the chain."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    WatermarkLogitsProcessor,
)

from lora_runtime.sampling.processors import (
    RowSettings,
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
    """transformers' processors one after another in TGI's order, for one row [1, vocab]."""
    scores = logits.clone()
    if row.watermark_previous_token_id is not None:
        watermark = WatermarkLogitsProcessor(VOCAB, "cpu", greenlist_ratio=0.5, bias=2.0)
        scores = watermark(torch.tensor([[row.watermark_previous_token_id]]), scores)
    if row.repetition_penalty is not None:
        scores = RepetitionPenaltyLogitsProcessor(row.repetition_penalty)(history[None], scores)
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


@pytest.mark.parametrize("num_rows", [1, 3, 7])
def test_chain_in_tgi_order_matches_transformers(num_rows: int) -> None:
    logits = torch.randn(num_rows, VOCAB) * 3
    histories = [torch.randint(0, VOCAB, (20,)) for _ in range(7)]
    allowed = torch.rand(VOCAB) < 0.3
    settings = [
        RowSettings(watermark_previous_token_id=5, repetition_penalty=1.3, penalty_token_ids=torch.unique(histories[0]),
                    temperature=0.7, top_k=40, top_p=0.9, typical_p=0.95),
        RowSettings(),
        RowSettings(allowed_tokens=allowed, temperature=1.5, top_p=0.8),
        RowSettings(repetition_penalty=0.7, penalty_token_ids=torch.unique(histories[3]), top_k=5),
        RowSettings(temperature=1.0, top_p=1.0, typical_p=1.0, top_k=0),
        RowSettings(watermark_previous_token_id=999, allowed_tokens=allowed, typical_p=0.5),
        RowSettings(temperature=0.3),
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
