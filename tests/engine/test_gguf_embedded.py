"""The embedded model's own GGUF, written by llama.cpp's converter (Q4_1 projections, a Q8_0 token
embedding, q/k rows in its rotary layout), served as it is, against transformers' float32 run of the
same file dequantized: on the PyTorch backend in float32, greedy tokens and their logprobs; as the
default model (`EngineConfig()`: bf16 activations on this CPU, the compiled backend's int8 activation
blocks), greedy tokens wherever the oracle's choice is not a near-tie, and nothing written to a cache.

Measured (Intel Xeon family 6 model 207): `EngineConfig()`'s free-running greedy tokens equal
transformers' `generate` on the first 0, 6, 12 and 32 of 32 new tokens for PROMPTS (and 25 and 24 of
32 for two more prompts); each parting is at a near-tie of the float32 run (its two best tokens 0.08,
0.10 and 0.05 apart in logprob), where rounding picks either."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.quantized import QuantizedWeight
from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.embedded import EMBEDDED_MODEL_NAME, gguf_path

ATOL = 2e-3  # 30 layers of float32 summed in other orders, on logprobs of magnitude ~10
NUM_NEW_TOKENS = 4
# The default serving path rounds activations to bf16 and, in every matmul of 30 layers, to int8 per
# 32-element block: its greedy tokens' logprobs moved by up to 0.27 from the float32 run's on these
# prompts (INT8_ATOL of test_gguf_model.py, 5e-2, is for its 2-layer random models). A token whose
# logprob is within DEFAULT_ATOL of the oracle's can lose only to one within 2 * DEFAULT_ATOL.
DEFAULT_ATOL = 0.4
DEFAULT_NEW_TOKENS = 16
PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
           "List three uses of a paperclip.", "What is 17 times 23?"]


@pytest.fixture(scope="module")
def reference():
    """transformers' float32 run of the embedded GGUF, dequantized by its `gguf_file=` loader."""
    from transformers import AutoModelForCausalLM

    path = gguf_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def _log_softmax(reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(reference(torch.tensor([ids])).logits[0], dim=-1)


def _chat(engine: Engine, question: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                add_generation_prompt=True)


def test_embedded_gguf_served_as_it_is_matches_transformers(reference) -> None:
    engine = Engine.from_config(EngineConfig(model=str(gguf_path()), dtype="float32", kernel_backend="torch"))
    layer = engine.model.weights.layers[0]
    assert [part.block_type.name for part in layer.qkv.weight.parts] == ["Q4_1"]
    assert isinstance(engine.model.weights.lm_head.weight, QuantizedWeight)  # tied: the Q8_0 embedding's blocks
    params = SamplingParams(max_new_tokens=NUM_NEW_TOKENS, ignore_eos_token=True, details=True)
    output = engine.generate([_chat(engine, PROMPTS[0])], params)[0]
    logprobs = _log_softmax(reference, output.prompt_token_ids + output.token_ids)
    first = len(output.prompt_token_ids) - 1
    assert output.token_ids == logprobs[first:-1].argmax(-1).tolist()
    expected = [logprobs[first + i, t].item() for i, t in enumerate(output.token_ids)]
    assert [t.logprob for t in output.tokens] == pytest.approx(expected, abs=ATOL)


def test_the_default_model_is_the_embedded_gguf_as_stored(reference, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))  # where a conversion would be written
    engine = Engine.from_config(EngineConfig())
    assert not cache.exists()
    assert engine.model_name == EMBEDDED_MODEL_NAME
    layer = engine.model.weights.layers[0]
    projections = [layer.qkv.weight, layer.o.weight, layer.gate_up.weight, layer.down.weight]
    assert all(isinstance(weight, QuantizedWeight) for weight in projections)
    params = SamplingParams(max_new_tokens=DEFAULT_NEW_TOKENS, ignore_eos_token=True, details=True)
    for output in engine.generate([_chat(engine, question) for question in PROMPTS], params):
        _assert_greedy_outside_near_ties(output, _log_softmax(reference, output.prompt_token_ids + output.token_ids))


def _assert_greedy_outside_near_ties(output, logprobs: torch.Tensor) -> None:
    """Each token's logprob within DEFAULT_ATOL of the oracle's (on our own sequence), and the token the
    oracle picks wherever its two best are more than 2 * DEFAULT_ATOL apart."""
    first = len(output.prompt_token_ids) - 1
    expected = [logprobs[first + i, t].item() for i, t in enumerate(output.token_ids)]
    assert [t.logprob for t in output.tokens] == pytest.approx(expected, abs=DEFAULT_ATOL)
    for i, token_id in enumerate(output.token_ids):
        best, second = logprobs[first + i].topk(2).values.tolist()
        if best - second > 2 * DEFAULT_ATOL:
            assert token_id == logprobs[first + i].argmax().item(), (i, output.token_ids)
