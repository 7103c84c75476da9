"""Every tensor a loaded model reads in its forward pass lives on the model's device: on CUDA, a table
left on the CPU (the rotary cos/sin once were) fails the first step with a device mismatch. Checked
on PyTorch's "meta" device, which any CPU has: tensors there carry a device and a shape, no data."""
from __future__ import annotations

import torch

import kernels
from lora_runtime.loader import load_model
from tests.engine.factories import save_tiny_model


def test_every_model_tensor_lives_on_the_models_device(tmp_path) -> None:
    save_tiny_model("qwen2", tmp_path)  # with biases, which the projections must carry over too
    model = load_model(tmp_path, "float32", "meta", kernels.backend_for("meta"))
    weights = model.weights
    linears = [weights.lm_head] + [getattr(layer, name) for layer in weights.layers for name in ("qkv", "o", "gate_up", "down")]
    tensors = [weights.embed_tokens, weights.final_norm, model.rotary.cos, model.rotary.sin]
    tensors += [norm for layer in weights.layers for norm in (layer.input_norm, layer.post_attention_norm)]
    tensors += [t for linear in linears for t in (linear.weight, linear.bias) if t is not None]
    assert {tensor.device for tensor in tensors} == {torch.device("meta")}
