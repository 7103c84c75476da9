"""The embedded model's Hugging Face directory in float32 (the weights the oracle loads; the default
model, its GGUF served as it is, is compared in test_default_model.py): greedy tokens identical to HF `generate` (run per prompt, batch
size 1, so no padding alters the oracle), whether our engine runs the prompts one at a time, all
together, or with a KV cache so small that requests are preempted and recomputed."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.config import KVCacheConfig, SchedulerConfig

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis to a child.",
    "List three uses of a paperclip.",
    "Translate 'good morning' into Spanish and explain its use.",
    "What is 17 times 23? Show your working.",
    "Give me a recipe for pancakes.",
    "Describe the colour blue to someone who cannot see. 🌊",
]
NUM_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompts(embedded_model_dir) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def hf_greedy(prompts, hf_embedded_model, embedded_model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            out = hf_embedded_model.generate(ids, max_new_tokens=NUM_NEW_TOKENS, do_sample=False)
            expected.append(out[0, ids.shape[1]:].tolist())
    return expected


def _engine(model_dir: Path, **kwargs) -> Engine:
    return Engine.from_config(EngineConfig(model=str(model_dir), dtype="float32", **kwargs))


def test_one_at_a_time_matches_hf(prompts, hf_greedy, embedded_model_dir) -> None:
    engine = _engine(embedded_model_dir)
    params = SamplingParams(max_new_tokens=NUM_NEW_TOKENS)
    for prompt, expected in zip(prompts, hf_greedy):
        assert engine.generate([prompt], params)[0].token_ids == expected


def test_all_together_matches_hf(prompts, hf_greedy, embedded_model_dir) -> None:
    engine = _engine(embedded_model_dir)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NUM_NEW_TOKENS))
    assert [o.token_ids for o in outputs] == hf_greedy
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_preemption_under_a_tiny_cache_matches_hf(prompts, hf_greedy, embedded_model_dir) -> None:
    engine = _engine(
        embedded_model_dir,
        kv_cache=KVCacheConfig(block_size_tokens=16, num_blocks=12),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    )
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NUM_NEW_TOKENS))
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == hf_greedy
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
