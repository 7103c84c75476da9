"""A GGUF file of random blocks of every supported quantized type (mixed as a Q4_K_M file mixes them)
served by the Triton backend (the interpreter on CPU, compiled on CUDA: tests/device.py): the same
model code takes `TritonQuantizedLinear` for every projection, and its greedy tokens and
logprobs match transformers' float32 run of the file dequantized (its `gguf_file=` loader) within
1e-4, as the PyTorch backend's do (tests/engine/test_gguf_model.py). Few prompts and tokens, the
embedded tokenizer cut to CUT_VOCAB_SIZE tokens, and a float32 head (the whole vocabulary's 49152
rows of blocks would take the interpreter minutes a step): the interpreter runs every kernel program
by program."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.quantized_matmul import TritonQuantizedLinear
from lora_runtime import Engine, EngineConfig, SamplingParams
from tests.device import TEST_DEVICE
from tests.engine.gguf_factory import CUT_VOCAB_SIZE, TinyDims, random_tensors, write_gguf

DIMS = TinyDims(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=1,
                vocab_size=CUT_VOCAB_SIZE)
TYPES = {"token_embd": "Q4_K", "output": "Q6_K",  # the output replaced by a float32 head below
         "attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K",
         "attn_output": "Q4_0", "ffn_gate": "Q4_K", "ffn_up": "Q4_1", "ffn_down": "Q8_0"}
PROMPTS = [[5, 17, 33], [9, 60, 2, 77, 1000]]
NUM_NEW_TOKENS = 2
ATOL = 1e-4


@pytest.mark.slow  # minutes under the interpreter on a busy 2-core machine
def test_k_quant_file_on_triton_matches_transformers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    tensors = random_tensors(DIMS, TYPES, seed=5)
    head = torch.randn(DIMS.vocab_size, DIMS.hidden_size, generator=torch.Generator().manual_seed(6)) * 0.05
    tensors["output.weight"] = "F32", np.ascontiguousarray(head.numpy())
    path = write_gguf(tmp_path / "tiny-k-quants.gguf", DIMS, tensors)
    engine = Engine.from_config(EngineConfig(model=str(path), dtype="float32", kernel_backend="triton",
                                             device=TEST_DEVICE))  # fmt: skip
    layer = engine.model.weights.layers[0]
    assert all(isinstance(linear, TritonQuantizedLinear) for linear in (layer.qkv, layer.o, layer.gate_up, layer.down))
    params = SamplingParams(max_new_tokens=NUM_NEW_TOKENS, ignore_eos_token=True, decoder_input_details=True,
                            details=True)  # fmt: skip
    outputs = engine.generate(PROMPTS, params)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        for output in outputs:
            ids = output.prompt_token_ids + output.token_ids
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
            first = len(output.prompt_token_ids) - 1
            assert output.token_ids == logprobs[first:-1].argmax(-1).tolist()
            expected = [logprobs[first + i, t].item() for i, t in enumerate(output.token_ids)]
            assert [t.logprob for t in output.tokens] == pytest.approx(expected, abs=ATOL)
