"""The Kirchenbauer green-list watermark as TGI applies it, and its z-test detector.

For each step a CPU generator is seeded with `hash_key * previous_token_id`; the green list is the
first `int(gamma * vocab_size)` ids of `torch.randperm(vocab_size)` drawn from it, and `delta` is
added to their logits. The first generated token is seeded by the last prompt token. This is the
arithmetic of transformers' `WatermarkLogitsProcessor` (lefthash, context width 1) on CPU, which is
the oracle, and texts are detected by its `WatermarkDetector` configured the same way.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

WATERMARK_GAMMA = 0.5
WATERMARK_DELTA = 2.0
WATERMARK_HASH_KEY = 15485863  # the millionth prime, TGI's and transformers' default key
DEFAULT_Z_THRESHOLD = 4.0


def green_list_ids(
    previous_token_id: int, vocab_size: int, gamma: float = WATERMARK_GAMMA, hash_key: int = WATERMARK_HASH_KEY
) -> torch.Tensor:
    """The green ids [int(gamma * vocab_size)] (int64, CPU) that follow `previous_token_id`."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed((hash_key * previous_token_id) % (2**64 - 1))
    permutation = torch.randperm(vocab_size, generator=generator)
    return permutation[: int(vocab_size * gamma)]


def add_watermark_bias(
    row: torch.Tensor, previous_token_id: int, gamma: float = WATERMARK_GAMMA, delta: float = WATERMARK_DELTA
) -> None:
    """Add `delta` in place to the green entries of one row of logits `row` [vocab]."""
    green = green_list_ids(previous_token_id, row.shape[0], gamma).to(row.device)
    row[green] += delta


@dataclass(frozen=True, slots=True)
class WatermarkDetection:
    """The z-test over the scored tokens: how many were green against the `gamma` expected."""

    num_tokens_scored: int
    num_green_tokens: int
    green_fraction: float
    z_score: float
    p_value: float
    is_watermarked: bool


def detect_watermark(
    prompt_last_token_id: int,
    generated_ids: Sequence[int],
    vocab_size: int,
    gamma: float = WATERMARK_GAMMA,
    hash_key: int = WATERMARK_HASH_KEY,
    z_threshold: float = DEFAULT_Z_THRESHOLD,
) -> WatermarkDetection:
    """Score `generated_ids`, each against the green list of the token before it (the first one
    against `prompt_last_token_id`), and z-test the green count. `vocab_size` is the logits width
    the text was generated with."""
    if not generated_ids:
        raise ValueError("detect_watermark needs at least one generated token")
    previous = [prompt_last_token_id, *generated_ids[:-1]]
    green_sets: dict[int, set[int]] = {}
    num_green = 0
    for prev_id, token_id in zip(previous, generated_ids):
        if prev_id not in green_sets:
            green_sets[prev_id] = set(green_list_ids(prev_id, vocab_size, gamma, hash_key).tolist())
        num_green += token_id in green_sets[prev_id]
    num_scored = len(generated_ids)
    z_score = (num_green - gamma * num_scored) / math.sqrt(num_scored * gamma * (1 - gamma))
    return WatermarkDetection(
        num_tokens_scored=num_scored,
        num_green_tokens=num_green,
        green_fraction=num_green / num_scored,
        z_score=z_score,
        p_value=0.5 * math.erfc(z_score / math.sqrt(2)),
        is_watermarked=z_score > z_threshold,
    )
