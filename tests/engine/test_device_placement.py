"""Every tensor a loaded model reads in its forward pass lives on the model's device: on CUDA, a table
left on the CPU (the rotary cos/sin once were) fails the first step with a device mismatch. Checked
on PyTorch's "meta" device, which any CPU has: tensors there carry a device and a shape, no data."""
from __future__ import annotations

import pytest
import torch

import kernels
from lora_runtime.loader import load_model
from tests.engine.factories import save_tiny_model


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text", "olmo2", "phi3"])
def test_every_model_tensor_lives_on_the_models_device(tmp_path, family: str) -> None:
    """Qwen2 with biases, Gemma 3 with its norms, q/k norms, two rotary tables and the embedding
    scale, OLMo 2's norms over whole projections, Phi-3's fused checkpoint: all carried over."""
    save_tiny_model(family, tmp_path)
    model = load_model(tmp_path, "float32", "meta", kernels.backend_for("meta"))
    weights = model.weights
    linears = [weights.lm_head] + [getattr(layer, name) for layer in weights.layers
                                   for name in ("qkv", "o", "gate_up", "down")]
    tensors = [weights.final_norm] + ([] if weights.embed_tokens is None else [weights.embed_tokens])  # tied: the head
    tensors += [table for rotary in model.rotary.values() for table in (rotary.cos, rotary.sin)]
    if torch.is_tensor(model.embedding_scale):
        tensors.append(model.embedding_scale)
    norms = ("attention_in_norm", "attention_out_norm", "mlp_in_norm", "mlp_out_norm", "q_norm", "k_norm")
    tensors += [getattr(layer, name) for layer in weights.layers for name in norms if getattr(layer, name) is not None]
    tensors += [t for linear in linears for t in (linear.weight, linear.bias) if t is not None]
    assert {tensor.device for tensor in tensors} == {torch.device("meta")}
