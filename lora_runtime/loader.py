"""Load a local Hugging Face directory of the Llama family into our model: config, safetensors
weights (fusing q/k/v and gate/up), rotary tables and the tokenizer."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

import kernels
from lora_runtime.dtypes import DTYPES
from lora_runtime.errors import ValidationError
from lora_runtime.layers.rotary import RotaryEmbedding
from lora_runtime.models.architectures import ModelShape, model_shape_from_config, rope_frequencies
from lora_runtime.models.llama import LayerWeights, LlamaModel, ModelWeights



class _TensorReader:
    """Reads named tensors across one or more safetensors files, cast to the model dtype."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: str) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ValidationError("model", f"no .safetensors weights in {model_dir.name}")
        self._handles = [safe_open(str(path), framework="pt") for path in files]
        self._where = {name: handle for handle in self._handles for name in handle.keys()}
        self.dtype = dtype
        self.device = device

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ValidationError("model", f"weight {name} missing from the checkpoint")
        return self._where[name].get_tensor(name).to(device=self.device, dtype=self.dtype)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if self.has(name) else None

    def fused(self, names: list[str]) -> torch.Tensor:
        return torch.cat([self.get(name) for name in names], dim=0).contiguous()


def _layer_weights(reader: _TensorReader, shape: ModelShape, layer_idx: int, backend: kernels.Backend) -> LayerWeights:
    prefix = f"model.layers.{layer_idx}."
    linear = backend.linear
    attn = [f"{prefix}self_attn.{name}_proj" for name in ("q", "k", "v")]
    return LayerWeights(
        input_norm=reader.get(prefix + "input_layernorm.weight"),
        qkv=linear(
            reader.fused([name + ".weight" for name in attn]),
            reader.fused([name + ".bias" for name in attn]) if shape.qkv_bias else None,
        ),
        o=linear(
            reader.get(prefix + "self_attn.o_proj.weight"),
            reader.get(prefix + "self_attn.o_proj.bias") if shape.o_bias else None,
        ),
        post_attention_norm=reader.get(prefix + "post_attention_layernorm.weight"),
        gate_up=linear(reader.fused([prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"])),
        down=linear(reader.get(prefix + "mlp.down_proj.weight")),
    )


def load_model(model_dir: Path, dtype: str, device: str, backend: kernels.Backend) -> LlamaModel:
    """Build our model from a local HF directory (config.json + *.safetensors), its projections laid
    out for `backend`'s matmuls. `dtype` is a concrete dtype ("auto" is resolved by the engine)."""
    from transformers import AutoConfig

    if not (model_dir / "config.json").is_file():
        raise ValidationError("model", f"{model_dir} is not a Hugging Face model directory (no config.json)")
    config = AutoConfig.from_pretrained(model_dir)
    shape = model_shape_from_config(config)
    torch_dtype = DTYPES[dtype]
    reader = _TensorReader(model_dir, torch_dtype, device)
    embed = reader.get("model.embed_tokens.weight")
    tied = shape.tie_word_embeddings or not reader.has("lm_head.weight")
    weights = ModelWeights(
        embed_tokens=embed,
        layers=[_layer_weights(reader, shape, idx, backend) for idx in range(shape.num_layers)],
        final_norm=reader.get("model.norm.weight"),
        lm_head=backend.linear(embed if tied else reader.get("lm_head.weight")),
    )
    inv_freq, attention_scaling = rope_frequencies(config, shape.head_dim)
    rotary = RotaryEmbedding(inv_freq, shape.max_model_len, attention_scaling, torch_dtype, device)
    return LlamaModel(shape, weights, rotary, backend)
