"""The embedded model's own GGUF, written by llama.cpp's converter (Q4_1 projections, a Q8_0 token
embedding, q/k rows in its rotary layout), served as it is: greedy tokens and their logprobs against
transformers' float32 run of the same file dequantized."""
from __future__ import annotations

import pytest
import torch

from kernels.quantized import QuantizedWeight
from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.embedded import gguf_path

ATOL = 2e-3  # 30 layers of float32 summed in other orders, on logprobs of magnitude ~10
NUM_NEW_TOKENS = 4


def test_embedded_gguf_served_as_it_is_matches_transformers() -> None:
    from transformers import AutoModelForCausalLM

    path = gguf_path()
    engine = Engine.from_config(EngineConfig(model=str(path), dtype="float32", kernel_backend="torch"))
    layer = engine.model.weights.layers[0]
    assert [part.block_type.name for part in layer.qkv.weight.parts] == ["Q4_1"]
    assert isinstance(engine.model.weights.lm_head.weight, QuantizedWeight)  # tied: the Q8_0 embedding's blocks
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                  tokenize=False, add_generation_prompt=True)
    params = SamplingParams(max_new_tokens=NUM_NEW_TOKENS, ignore_eos_token=True, details=True)
    output = engine.generate([prompt], params)[0]
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = output.prompt_token_ids + output.token_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([ids])).logits[0], dim=-1)
    first = len(output.prompt_token_ids) - 1
    assert output.token_ids == logprobs[first:-1].argmax(-1).tolist()
    expected = [logprobs[first + i, t].item() for i, t in enumerate(output.token_ids)]
    assert [t.logprob for t in output.tokens] == pytest.approx(expected, abs=ATOL)
