"""Watermarked text is detected by transformers' WatermarkDetector and by ours; plain text is not."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.generation import WatermarkDetector, WatermarkingConfig

from lora_runtime.core import SamplingParams
from lora_runtime.sampling import Sampler, SamplingState, TokenizerInfo, detect_watermark

VOCAB = 2000
NUM_TOKENS = 120
PROMPT = [11, 12, 13]


def _sample_text(watermark: bool, seed: int) -> list[int]:
    """Tokens sampled by our Sampler from random logits of a moderate entropy."""
    info = TokenizerInfo(tokenizer=None, vocab_size=VOCAB, eos_token_ids=[0])
    state = SamplingState(SamplingParams(do_sample=True, seed=seed, watermark=watermark), PROMPT, info)
    logits = torch.randn(NUM_TOKENS, VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5
    logits[:, 0] = -1e9  # no EOS: keep every step scoreable
    for step in range(NUM_TOKENS):
        state.accept(Sampler().sample(logits[step : step + 1], [state]).token_ids[0])
    return state.token_ids


def _transformers_detector() -> WatermarkDetector:
    config = LlamaConfig(vocab_size=VOCAB, bos_token_id=VOCAB - 1)  # a bos id that never occurs here
    watermarking = WatermarkingConfig(
        greenlist_ratio=0.5, bias=2.0, hashing_key=15485863, seeding_scheme="lefthash", context_width=1
    )
    return WatermarkDetector(config, "cpu", watermarking)


@pytest.mark.parametrize("seed", [1, 2])
def test_watermarked_text_is_detected_and_plain_text_is_not(seed: int) -> None:
    detector = _transformers_detector()
    for watermark in (True, False):
        generated = _sample_text(watermark, seed)
        oracle = detector(torch.tensor([[PROMPT[-1], *generated]]), z_threshold=4.0, return_dict=True)
        ours = detect_watermark(PROMPT[-1], generated, VOCAB)
        assert ours.num_tokens_scored == int(oracle.num_tokens_scored[0]) == NUM_TOKENS
        assert ours.num_green_tokens == int(oracle.num_green_tokens[0])
        assert ours.z_score == pytest.approx(float(oracle.z_score[0]))
        assert ours.is_watermarked == bool(oracle.prediction[0]) == watermark
        if watermark:
            assert ours.z_score > 6 and ours.p_value < 1e-8
        else:
            assert abs(ours.z_score) < 3


def test_detector_needs_tokens() -> None:
    with pytest.raises(ValueError):
        detect_watermark(3, [], VOCAB)
