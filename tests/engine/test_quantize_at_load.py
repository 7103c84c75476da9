"""`EngineConfig(quantization="q8_0")`: a Hugging Face checkpoint's projections and head quantized to
Q8_0 while loading, against transformers running the same checkpoint with those weights replaced by
their Q8_0 round trip (gguf's quantizer, bit for bit: tests/kernels/test_dequantize.py): logprobs
within 1e-4 on the PyTorch backend, within the activation quantization's INT8_ATOL on the compiled
one; greedy tokens equal. Tied, the head's one Q8_0 copy is the embedding too (its rows looked up),
and the model holds the budget's estimate of its bytes: no dense copy of either. Projections that are
not whole blocks of 32 inputs are refused naming the field."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoTokenizer

import kernels
from kernels import reference
from kernels.quantized import quantize_q8_0
from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.embedded import ensure_embedded_model
from lora_runtime.errors import ValidationError
from lora_runtime.loader import load_model
from lora_runtime.memory_budget import checkpoint_weights_bytes
from tests.engine.factories import save_tiny_model
from tests.engine.test_gguf_memory import held_storages
from tests.engine.test_gguf_model import ATOL, INT8_ATOL

PROMPTS = [[5, 17, 33, 9], [60, 2, 77], [11, 12, 13, 14, 15, 16]]
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def _round_trip(model):
    """A copy of `model` with every projection's weight and the head's (tied: the embedding's too, one
    parameter) replaced by its Q8_0 round trip."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in twin.named_modules():
            if name.rsplit(".", 1)[-1] in QUANTIZED:
                module.weight.copy_(reference.dequantize(quantize_q8_0(module.weight)))
    return twin


# qwen2: biases on q/k/v, added after the quantized matmul; llama-tied: one Q8_0 copy for head and lookup.
@pytest.mark.parametrize("family", ["qwen2", "llama-tied"])
@pytest.mark.parametrize("backend", ["torch", None])
def test_q8_0_at_load_matches_transformers_on_the_round_trip(tmp_path, backend, family: str) -> None:
    hf_model = save_tiny_model(family, tmp_path)
    AutoTokenizer.from_pretrained(ensure_embedded_model()).save_pretrained(tmp_path)
    engine = Engine.from_config(EngineConfig(model=str(tmp_path), dtype="float32", kernel_backend=backend,
                                             quantization="q8_0"))
    weights = engine.model.weights
    assert weights.layers[0].qkv.weight.parts[0].block_type.name == "Q8_0"
    assert weights.lm_head.weight.parts[0].block_type.name == "Q8_0"
    params = SamplingParams(max_new_tokens=5, ignore_eos_token=True, details=True)
    twin = _round_trip(hf_model)
    atol = ATOL if backend == "torch" else INT8_ATOL
    with torch.no_grad():
        for output in engine.generate(PROMPTS, params):
            ids = output.prompt_token_ids + output.token_ids
            logprobs = torch.log_softmax(twin(torch.tensor([ids])).logits[0], dim=-1)
            first = len(output.prompt_token_ids) - 1
            assert output.token_ids == logprobs[first:-1].argmax(-1).tolist()
            expected = [logprobs[first + i, t].item() for i, t in enumerate(output.token_ids)]
            assert [t.logprob for t in output.tokens] == pytest.approx(expected, abs=atol)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_a_tied_head_is_one_q8_0_copy_and_the_model_holds_the_budgets_bytes(tmp_path, backend_name: str) -> None:
    hf_model = save_tiny_model("llama-tied", tmp_path)
    backend = kernels.backend_for("cpu", backend_name)
    weights = load_model(tmp_path, "float32", "cpu", backend, quantization="q8_0").weights
    assert weights.embed_tokens is None, "tied: the head's blocks are the embedding"
    assert sum(held_storages(weights).values()) == checkpoint_weights_bytes(tmp_path, "float32", "q8_0")
    ids = torch.tensor([0, 96, 5, 5, 40])
    embedding = hf_model.model.embed_tokens.weight.detach()
    expected = reference.dequantize(quantize_q8_0(embedding))[ids]
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(weights.lm_head.rows(ids, dtype), expected.to(dtype))


def test_projections_not_whole_blocks_refused(tmp_path, monkeypatch) -> None:
    from tests.engine import factories

    monkeypatch.setitem(factories.TINY_DIMS, "hidden_size", 48)
    save_tiny_model("llama", tmp_path)
    AutoTokenizer.from_pretrained(ensure_embedded_model()).save_pretrained(tmp_path)
    with pytest.raises(ValidationError) as refused:
        Engine.from_config(EngineConfig(model=str(tmp_path), dtype="float32", quantization="q8_0"))
    assert refused.value.field == "quantization" and "48" in str(refused.value)


def test_the_service_option_reaches_the_engine_config() -> None:
    import argparse

    from server.launch import add_service_options, engine_config

    parser = argparse.ArgumentParser()
    add_service_options(parser)
    assert engine_config(parser.parse_args([])).quantization is None
    assert engine_config(parser.parse_args(["--quantization", "q8_0"])).quantization == "q8_0"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "q4_k"])
