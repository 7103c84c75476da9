"""Load a local Hugging Face directory of a family we serve into our model: config, safetensors
weights (fusing q/k/v and gate/up where the checkpoint keeps them apart), rotary tables and the
tokenizer. The config is read, and anything in it we do not compute refused, before any weight."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

import kernels
from lora_runtime.dtypes import DTYPES
from kernels.quantized import QuantizedWeight, quantize_q8_0
from lora_runtime.errors import ValidationError
from lora_runtime.models.architectures import (
    ModelFeatures,
    ModelShape,
    model_features_from_config,
    model_shape_from_config,
)
from lora_runtime.models.llama import LayerWeights, LlamaModel, ModelWeights
from lora_runtime.models.rope import rotary_tables


class _TensorReader:
    """Reads named tensors across one or more safetensors files, checked against the shape the model
    needs and cast to the model dtype."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: str) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ValidationError("model", f"no .safetensors weights in {model_dir.name}")
        self._handles = {path.name: safe_open(str(path), framework="pt") for path in files}
        self._where = {name: file for file, handle in self._handles.items() for name in handle.keys()}
        self.dtype = dtype
        self.device = device

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name`, which must have `shape`, in `dtype` (the model's by default)."""
        if name not in self._where:
            raise ValidationError("model", f"weight {name} missing from the checkpoint ({', '.join(self._handles)})")
        file = self._where[name]
        tensor = self._handles[file].get_tensor(name)
        if tuple(tensor.shape) != shape:
            raise ValidationError("model", f"weight {name} in {file} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor.to(device=self.device, dtype=dtype or self.dtype)

    def fused(self, names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        return torch.cat([self.get(name, shape) for name, shape in zip(names, shapes)], dim=0).contiguous()


class _LayerReader:
    """The weights of one decoder layer, as the family lays them out in its checkpoint."""

    def __init__(self, reader: _TensorReader, shape: ModelShape, features: ModelFeatures,
                 backend: kernels.Backend, quantization: str | None = None) -> None:
        self.reader, self.shape, self.features, self.backend = reader, shape, features, backend
        self.quantization = quantization

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """A projection for the backend, quantized first where the engine was asked to."""
        if self.quantization is None:
            return self.backend.linear(weight, bias)
        if self.quantization != "q8_0":
            raise ValidationError("quantization", f"unknown quantization {self.quantization!r}; supported: q8_0")
        if weight.shape[1] % 32:
            raise ValidationError("quantization", f"q8_0 needs projections of whole blocks of 32 inputs, "
                                                  f"not {weight.shape[1]}")
        return self.backend.linear(QuantizedWeight.of([quantize_q8_0(weight)]), bias)

    def norm(self, name: str, width: int) -> torch.Tensor:
        """A norm's weight; Gemma's `x * (1 + w)` becomes a plain scale, 1 + w summed in float32 as HF does."""
        if not self.features.spec.norm_plus_one:
            return self.reader.get(name, (width,))
        return (self.reader.get(name, (width,), torch.float32) + 1.0).to(self.reader.dtype)

    def optional_norm(self, prefix: str, name: str | None) -> torch.Tensor | None:
        return None if name is None else self.norm(f"{prefix}{name}.weight", self.shape.hidden_size)

    def layer(self, layer_idx: int) -> LayerWeights:
        prefix, shape, norms = f"model.layers.{layer_idx}.", self.shape, self.features.spec.norms
        linear, hidden = self.linear, shape.hidden_size
        o_shape = (hidden, shape.q_size)
        o_bias = self.reader.get(prefix + "self_attn.o_proj.bias", (hidden,)) if shape.o_bias else None
        weights = LayerWeights(
            qkv=linear(self._qkv_weight(prefix), self._qkv_bias(prefix) if shape.qkv_bias else None),
            o=linear(self.reader.get(prefix + "self_attn.o_proj.weight", o_shape), o_bias),
            gate_up=linear(self._gate_up_weight(prefix)),
            down=linear(self.reader.get(prefix + "mlp.down_proj.weight", (hidden, shape.intermediate_size))),
            attention_in_norm=self.optional_norm(prefix, norms.attention_in),
            attention_out_norm=self.optional_norm(prefix, norms.attention_out),
            mlp_in_norm=self.optional_norm(prefix, norms.mlp_in),
            mlp_out_norm=self.optional_norm(prefix, norms.mlp_out),
        )
        qk_norm = self.features.spec.qk_norm
        if qk_norm is not None:
            q_width, k_width = (shape.head_dim, shape.head_dim) if qk_norm == "head" else (shape.q_size, shape.kv_size)
            weights.q_norm = self.norm(prefix + "self_attn.q_norm.weight", q_width)
            weights.k_norm = self.norm(prefix + "self_attn.k_norm.weight", k_width)
        return weights

    def _qkv_weight(self, prefix: str) -> torch.Tensor:
        shape, hidden = self.shape, self.shape.hidden_size
        if self.features.spec.fused_checkpoint:
            return self.reader.get(prefix + "self_attn.qkv_proj.weight", (shape.q_size + 2 * shape.kv_size, hidden))
        return self.reader.fused([f"{prefix}self_attn.{name}_proj.weight" for name in "qkv"],
                                 [(shape.q_size, hidden), (shape.kv_size, hidden), (shape.kv_size, hidden)])

    def _qkv_bias(self, prefix: str) -> torch.Tensor:
        shape = self.shape
        return self.reader.fused([f"{prefix}self_attn.{name}_proj.bias" for name in "qkv"],
                                 [(shape.q_size,), (shape.kv_size,), (shape.kv_size,)])

    def _gate_up_weight(self, prefix: str) -> torch.Tensor:
        width, hidden = self.shape.intermediate_size, self.shape.hidden_size
        if self.features.spec.fused_checkpoint:
            return self.reader.get(prefix + "mlp.gate_up_proj.weight", (2 * width, hidden))
        return self.reader.fused([prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"],
                                 [(width, hidden), (width, hidden)])


def load_model(model_dir: Path, dtype: str, device: str, backend: kernels.Backend,
               quantization: str | None = None) -> LlamaModel:
    """Build our model from a local HF directory (config.json + *.safetensors), its projections laid
    out for `backend`'s matmuls (quantized first: `quantization`, EngineConfig's). `dtype` is a concrete
    dtype ("auto" is resolved by the engine)."""
    from transformers import AutoConfig

    if not (model_dir / "config.json").is_file():
        raise ValidationError("model", f"{model_dir} is not a Hugging Face model directory (no config.json)")
    config = AutoConfig.from_pretrained(model_dir)
    shape = model_shape_from_config(config)
    features = model_features_from_config(config, shape)
    torch_dtype = DTYPES[dtype]
    reader = _TensorReader(model_dir, torch_dtype, device)
    layers = _LayerReader(reader, shape, features, backend, quantization)
    embed = reader.get("model.embed_tokens.weight", (shape.vocab_size, shape.hidden_size))
    tied = shape.tie_word_embeddings or not reader.has("lm_head.weight")
    weights = ModelWeights(
        embed_tokens=embed,
        layers=[layers.layer(idx) for idx in range(shape.num_layers)],
        final_norm=layers.norm("model.norm.weight", shape.hidden_size),
        lm_head=backend.linear(embed if tied else reader.get("lm_head.weight", (shape.vocab_size, shape.hidden_size)),
                               few_rows=True),
    )
    rotary = rotary_tables(config, features.layer_rope, shape.head_dim, shape.max_model_len, torch_dtype, device)
    return LlamaModel(shape, weights, rotary, backend, features)
