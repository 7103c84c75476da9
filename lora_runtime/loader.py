"""Load a local Hugging Face directory of a family we serve into our model: config, safetensors
weights (fusing q/k/v and gate/up where the checkpoint keeps them apart), rotary tables and the
tokenizer. The config is read, and anything in it we do not compute refused, before any weight."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

import kernels
from lora_runtime.checkpoint import Checkpoint, empty_buffer
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

LOG = logging.getLogger(__name__)


class _TensorReader:
    """Reads named tensors of a checkpoint (lora_runtime/checkpoint.py) a tensor at a time, checked
    against the shape the model needs and cast to the model dtype: no tensor of the model is a view
    of the checkpoint's files, and none is read twice."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, device: str) -> None:
        self.checkpoint, self.dtype, self.device = checkpoint, dtype, device

    def has(self, name: str) -> bool:
        return name in self.checkpoint.entries

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name`, which must have `shape`, in `dtype` (the model's by default)."""
        out = empty_buffer(shape, dtype or self.dtype)
        self._read_into(name, out)
        return out.to(self.device)

    def fused(self, names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        """The tensors concatenated along dim 0, each read into its rows (no copy of the whole)."""
        out = empty_buffer((sum(shape[0] for shape in shapes), *shapes[0][1:]), self.dtype)
        first = 0
        for name, shape in zip(names, shapes):
            self._read_into(name, out[first:first + shape[0]])
            first += shape[0]
        return out.to(self.device)

    def _read_into(self, name: str, out: torch.Tensor) -> None:
        """Tensor `name` into `out` (of its expected shape, contiguous, on the CPU), cast on the way."""
        entry = self.checkpoint.entries.get(name)
        if entry is None:
            raise ValidationError("model", f"weight {name} missing from the checkpoint ({self.checkpoint.file_names()})")
        if entry.shape != tuple(out.shape):
            raise ValidationError("model", f"weight {name} in {entry.file.name} has shape {entry.shape}, "
                                           f"expected {tuple(out.shape)}")
        if entry.dtype == out.dtype:
            self.checkpoint.read_into(name, out)
        else:
            out.copy_(self.checkpoint.read(name))


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


def read_hf_config(model_dir: Path):
    """The directory's Hugging Face config (transformers' `PretrainedConfig`); refused without one."""
    from transformers import AutoConfig

    if not (model_dir / "config.json").is_file():
        raise ValidationError("model", f"{model_dir} is not a Hugging Face model directory (no config.json)")
    return AutoConfig.from_pretrained(model_dir)


def load_model(model_dir: Path, dtype: str, device: str, backend: kernels.Backend,
               quantization: str | None = None) -> LlamaModel:
    """Build our model from a local HF directory (config.json + *.safetensors), its projections laid
    out for `backend`'s matmuls (quantized first: `quantization`, EngineConfig's). `dtype` is a concrete
    dtype ("auto" is resolved by the engine)."""
    config = read_hf_config(model_dir)
    shape = model_shape_from_config(config)
    features = model_features_from_config(config, shape)
    torch_dtype = DTYPES[dtype]
    started = time.perf_counter()
    with Checkpoint(model_dir) as checkpoint:
        weights = _read_weights(_TensorReader(checkpoint, torch_dtype, device), shape, features, backend, quantization)
    LOG.info("loaded %s: %d tensors, %.2f GiB from %d file(s) in %.1f s", model_dir.name, len(checkpoint.entries),
             sum(entry.num_bytes for entry in checkpoint.entries.values()) / 2**30, len(checkpoint.files),
             time.perf_counter() - started)
    rotary = rotary_tables(config, features.layer_rope, shape.head_dim, shape.max_model_len, torch_dtype, device)
    return LlamaModel(shape, weights, rotary, backend, features)


def _read_weights(reader: _TensorReader, shape: ModelShape, features: ModelFeatures, backend: kernels.Backend,
                  quantization: str | None) -> ModelWeights:
    """Every weight, a layer at a time, each projection laid out for the backend as it is read."""
    layers = _LayerReader(reader, shape, features, backend, quantization)
    embed = reader.get("model.embed_tokens.weight", (shape.vocab_size, shape.hidden_size))
    tied = shape.tie_word_embeddings or not reader.has("lm_head.weight")
    # The head quantized as the projections are; tied, its one copy (packed, or quantized) is the
    # embedding too: the lookup reads its rows (`LlamaModel._embed`).
    head = layers.linear(embed if tied else reader.get("lm_head.weight", (shape.vocab_size, shape.hidden_size)))
    return ModelWeights(
        embed_tokens=None if tied else embed,
        layers=[layers.layer(idx) for idx in range(shape.num_layers)],
        final_norm=layers.norm("model.norm.weight", shape.hidden_size),
        lm_head=head,
    )
