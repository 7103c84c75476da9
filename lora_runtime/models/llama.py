"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM), over a paged KV cache.

Weights are plain tensors: q/k/v fused into one projection and gate/up into another, so each layer
runs four matmuls. The differences between architectures are in `architectures.ARCHITECTURES`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from lora_runtime.forward_batch import ForwardBatch
from lora_runtime.layers.linear import Linear
from lora_runtime.layers.norm import rms_norm
from lora_runtime.layers.rotary import RotaryEmbedding, apply_rotary
from lora_runtime.models.architectures import ModelShape


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [q_size + 2 * kv_size, hidden], bias for some architectures
    o: Linear  # [hidden, q_size]
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear  # [hidden, intermediate]


@dataclass(slots=True)
class ModelWeights:
    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: Linear  # [vocab, hidden], the embedding itself when tied


@dataclass(slots=True)
class KVCacheTensors:
    """Per-layer caches `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    key: list[torch.Tensor]
    value: list[torch.Tensor]

    @classmethod
    def allocate(cls, shape: ModelShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: str) -> KVCacheTensors:
        dims = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        return cls(
            key=[torch.zeros(dims, dtype=dtype, device=device) for _ in range(shape.num_layers)],
            value=[torch.zeros(dims, dtype=dtype, device=device) for _ in range(shape.num_layers)],
        )


class LlamaModel:
    def __init__(self, shape: ModelShape, weights: ModelWeights, rotary: RotaryEmbedding) -> None:
        self.shape = shape
        self.weights = weights
        self.rotary = rotary
        self.scale = shape.head_dim**-0.5

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed_tokens.dtype

    def forward(self, batch: ForwardBatch, kv_cache: KVCacheTensors) -> torch.Tensor:
        """Run one step; returns float32 logits `[num_logit_rows, vocab]` for `batch.logits_indices`."""
        hidden = F.embedding(batch.input_ids, self.weights.embed_tokens)  # [num_tokens, hidden]
        cos, sin = self.rotary.tables(batch.positions)
        for layer_idx, layer in enumerate(self.weights.layers):
            hidden = hidden + self._attention(layer_idx, layer, hidden, batch, kv_cache, cos, sin)
            hidden = hidden + self._mlp(layer_idx, layer, hidden, batch)
        selected = hidden.index_select(0, batch.logits_indices)
        normed = rms_norm(selected, self.weights.final_norm, self.shape.rms_norm_eps)
        return self.weights.lm_head(normed).float()

    def _attention(
        self,
        layer_idx: int,
        layer: LayerWeights,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: KVCacheTensors,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        shape = self.shape
        x = rms_norm(hidden, layer.input_norm, shape.rms_norm_eps)
        qkv = self._project(layer_idx, "qkv", x, layer.qkv, batch)
        num_tokens = hidden.shape[0]
        # q and k heads are adjacent in the fused output: rotate them in one call.
        qk = qkv[:, : shape.q_size + shape.kv_size].unflatten(-1, (shape.num_heads + shape.num_kv_heads, shape.head_dim))
        qk = apply_rotary(qk, cos, sin)  # [num_tokens, num_heads + num_kv_heads, head_dim]
        q, k = qk[:, : shape.num_heads], qk[:, shape.num_heads :]
        v = qkv[:, shape.q_size + shape.kv_size :].unflatten(-1, (shape.num_kv_heads, shape.head_dim))
        key_cache, value_cache = kv_cache.key[layer_idx], kv_cache.value[layer_idx]
        kernels.store_kv(k, v, key_cache, value_cache, batch.slot_mapping)
        attended = kernels.paged_attention(q, key_cache, value_cache, batch.attention, self.scale)
        attended = attended.reshape(num_tokens, shape.q_size)
        return self._project(layer_idx, "o", attended, layer.o, batch)

    def _mlp(self, layer_idx: int, layer: LayerWeights, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = rms_norm(hidden, layer.post_attention_norm, self.shape.rms_norm_eps)
        gate_up = self._project(layer_idx, "gate_up", x, layer.gate_up, batch)
        gate, up = gate_up.chunk(2, dim=-1)
        return self._project(layer_idx, "down", F.silu(gate) * up, layer.down, batch)

    @staticmethod
    def _project(layer_idx: int, projection: str, x: torch.Tensor, linear: Linear, batch: ForwardBatch) -> torch.Tensor:
        y = linear(x)
        if batch.lora is not None:
            batch.lora.apply(layer_idx, projection, y, x)
        return y
