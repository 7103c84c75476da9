"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM), over a paged KV cache.

Weights are plain tensors: q/k/v fused into one projection and gate/up into another, so each layer
runs four matmuls, each laid out once for the backend's matmul (`Backend.linear`). Every op runs on
the model's kernel backend, chosen once for its device. The differences between architectures are
in `architectures.ARCHITECTURES`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from kernels.huge_pages import empty_on_huge_pages
from kernels.linear import NO_READS, LinearWeight, Reads
from lora_runtime.forward_batch import ForwardBatch
from lora_runtime.layers.rotary import RotaryEmbedding
from lora_runtime.models.architectures import ModelShape


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: LinearWeight  # [q_size + 2 * kv_size, hidden], bias for some architectures
    o: LinearWeight  # [hidden, q_size]
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up: LinearWeight  # [2 * intermediate, hidden]
    down: LinearWeight  # [hidden, intermediate]


@dataclass(slots=True)
class ModelWeights:
    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: LinearWeight  # [vocab, hidden], the embedding itself when tied


@dataclass(slots=True)
class KVCacheTensors:
    """Per-layer caches `[num_blocks, block_size, num_kv_heads, head_dim]`, zeroed, on huge pages where
    the system has them (kernels/huge_pages.py: every decode step reads them)."""

    key: list[torch.Tensor]
    value: list[torch.Tensor]

    @classmethod
    def allocate(cls, shape: ModelShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: str) -> KVCacheTensors:
        # One allocation, so that only its end is rounded up to a whole huge page.
        both = empty_on_huge_pages((2, shape.num_layers, num_blocks, block_size, shape.num_kv_heads, shape.head_dim),
                                   dtype, device).zero_()
        return cls(key=list(both[0].unbind()), value=list(both[1].unbind()))


class LlamaModel:
    def __init__(self, shape: ModelShape, weights: ModelWeights, rotary: RotaryEmbedding, backend: kernels.Backend) -> None:
        self.backend = backend
        self.shape = shape
        self.weights = weights
        self.rotary = rotary
        self.scale = shape.head_dim**-0.5

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed_tokens.dtype

    def forward(self, batch: ForwardBatch, kv_cache: KVCacheTensors) -> torch.Tensor:
        """Run one step; returns logits `[num_logit_rows, vocab]` for `batch.logits_indices`, in the
        model's dtype (HF's bf16 logits are these same values; consumers widen to float32 where they
        compute, which for greedy decoding is inside the backend's `max_logsumexp`).

        The residual stream is kept apart from the normalised activations: each norm adds the
        sublayer's output into the residual in place and normalises the sum in one fused op."""
        eps = self.shape.rms_norm_eps
        layers = self.weights.layers
        residual = F.embedding(batch.input_ids, self.weights.embed_tokens)  # [num_tokens, hidden]
        x = self.backend.rms_norm(residual, layers[0].input_norm, eps)
        for layer_idx, layer in enumerate(layers):
            attended = self._attention(layer_idx, layer, x, batch, kv_cache)
            x = self.backend.rms_norm(attended, layer.post_attention_norm, eps, residual=residual)
            next_norm = layers[layer_idx + 1].input_norm if layer_idx + 1 < len(layers) else self.weights.final_norm
            x = self.backend.rms_norm(self._mlp(layer_idx, layer, x, batch), next_norm, eps, residual=residual)
        return self.weights.lm_head(x.index_select(0, batch.logits_indices))

    def _attention(
        self, layer_idx: int, layer: LayerWeights, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCacheTensors
    ) -> torch.Tensor:
        shape = self.shape
        key_cache, value_cache = kv_cache.key[layer_idx], kv_cache.value[layer_idx]
        cache_reads = self.backend.attention_reads(key_cache, value_cache, batch.attention)
        qkv = self._project(layer_idx, "qkv", x, layer.qkv, batch, cache_reads)
        self.backend.rotary_store_kv(qkv, batch.positions, self.rotary.cos, self.rotary.sin, key_cache, value_cache,
                                batch.slot_mapping, shape.num_heads, shape.num_kv_heads)
        q = qkv[:, : shape.q_size].unflatten(-1, (shape.num_heads, shape.head_dim))
        attended = self.backend.paged_attention(q, key_cache, value_cache, batch.attention, self.scale)
        return self._project(layer_idx, "o", attended.reshape(x.shape[0], shape.q_size), layer.o, batch)

    def _mlp(self, layer_idx: int, layer: LayerWeights, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        gate_up = self._project(layer_idx, "gate_up", x, layer.gate_up, batch)
        return self._project(layer_idx, "down", self.backend.silu_and_mul(gate_up), layer.down, batch)

    @staticmethod
    def _project(layer_idx: int, projection: str, x: torch.Tensor, linear: LinearWeight, batch: ForwardBatch,
                 reads: Reads = NO_READS) -> torch.Tensor:
        """The projection, and its adapters' deltas; its matmul requests what the op after the
        projection reads (`reads`) while it computes."""
        y = linear(x, reads)
        if batch.lora is not None:
            batch.lora.apply(layer_idx, projection, y, x)
        return y
