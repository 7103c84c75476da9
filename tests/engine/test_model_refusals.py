"""A model we cannot serve exactly is refused by name: an architecture or a feature of a config we
do not compute, before any weight is read (the weights file here is not even safetensors), and a
checkpoint with a missing or mis-shaped tensor, naming the tensor and its file."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import kernels
from lora_runtime.errors import ValidationError
from lora_runtime.loader import load_model
from tests.engine.factories import TINY_DIMS, save_tiny_model


def _refused(directory) -> str:
    with pytest.raises(ValidationError) as error:
        load_model(directory, "float32", "cpu", kernels.backend_for("cpu", "torch"))
    return str(error.value)


def _config_only(tmp_path, config):
    config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not read: the config is refused first")
    return tmp_path


@pytest.mark.parametrize("make_config,named", [
    (lambda: __import__("transformers").GPT2Config(n_layer=2), "'gpt2'"),
    (lambda: __import__("transformers").LlamaConfig(**TINY_DIMS, rope_parameters={
        "rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}), "'proportional'"),
    (lambda: __import__("transformers").LlamaConfig(**TINY_DIMS, rope_parameters={
        "rope_type": "axial", "rope_theta": 10000.0}), "'axial'"),
    # LongRoPE only where HF's generate recomputes at its switch (Phi-3), not on Llama, whose does not.
    (lambda: __import__("transformers").LlamaConfig(**TINY_DIMS, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 64}), "'longrope' is not supported for 'llama'"),
    (lambda: __import__("transformers").LlamaConfig(**TINY_DIMS, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}), "partial_rotary_factor 0.5"),
    (lambda: __import__("transformers").Gemma2Config(**TINY_DIMS, hidden_activation="relu", pad_token_id=0), "'relu'"),
    (lambda: __import__("transformers").Qwen3Config(**{**TINY_DIMS, "num_hidden_layers": 2}, sliding_window=4,
                                                   use_sliding_window=True,
                                                   layer_types=["chunked_attention", "full_attention"]),
     "chunked_attention"),
])
def test_what_we_do_not_compute_is_refused_by_name_before_any_weight(tmp_path, make_config, named) -> None:
    assert named in _refused(_config_only(tmp_path, make_config()))


def _rewrite_weights(directory, change) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_a_missing_tensor_is_named_with_the_checkpoint_file(tmp_path) -> None:
    save_tiny_model("qwen3", tmp_path)
    _rewrite_weights(tmp_path, lambda tensors: tensors.pop("model.layers.1.self_attn.k_norm.weight"))
    message = _refused(tmp_path)
    assert "model.layers.1.self_attn.k_norm.weight" in message and "model.safetensors" in message


def test_a_mis_shaped_tensor_is_named_with_its_file_and_shapes(tmp_path) -> None:
    save_tiny_model("phi3", tmp_path)
    name = "model.layers.0.mlp.gate_up_proj.weight"
    _rewrite_weights(tmp_path, lambda tensors: tensors.update({name: torch.zeros(96, 64)}))
    message = _refused(tmp_path)
    assert name in message and "model.safetensors" in message and "(96, 64)" in message and "(192, 64)" in message

