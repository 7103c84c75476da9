"""The one decoder of every family we serve (Llama, Mistral, Qwen 2/3, Granite, OLMo 2, SmolLM3,
Phi-3, Gemma 2/3), over a paged KV cache.

Weights are plain tensors: q/k/v fused into one projection and gate/up into another, so each layer
runs four matmuls, each laid out once for the backend's matmul (`Backend.linear`). Every op runs on
the model's kernel backend, chosen once for its device. The differences between families are data
(`architectures.ModelFeatures`, and which norms a layer has); this file holds the few steps they
switch on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from kernels.huge_pages import zeros_on_huge_pages
from kernels.linear import NO_READS, LinearWeight, Reads
from kernels.reference import split_qkv
from lora_runtime.forward_batch import ForwardBatch
from lora_runtime.layers.rotary import RotaryEmbedding
from lora_runtime.models.architectures import ModelFeatures, ModelShape
from lora_runtime.models.rope import recompute_length, rope_variant


@dataclass(slots=True)
class LayerWeights:
    qkv: LinearWeight  # [q_size + 2 * kv_size, hidden], bias for some architectures
    o: LinearWeight  # [hidden, q_size]
    gate_up: LinearWeight  # [2 * intermediate, hidden]
    down: LinearWeight  # [hidden, intermediate]
    # Norm weights `[hidden]` (Gemma's 1 + w folded in), None where the family has no such norm.
    attention_in_norm: torch.Tensor | None
    attention_out_norm: torch.Tensor | None
    mlp_in_norm: torch.Tensor | None
    mlp_out_norm: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # [head_dim] (per head) or [q_size] (over the projection)
    k_norm: torch.Tensor | None = None  # [head_dim] or [kv_size]


@dataclass(slots=True)
class ModelWeights:
    # [vocab, hidden], looked up by row: a dense table, a quantized weight's projection (its `rows`
    # dequantize only the rows looked up), or None when tied: the head's one copy (`lm_head.rows`).
    embed_tokens: torch.Tensor | LinearWeight | None
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
        both = zeros_on_huge_pages((2, shape.num_layers, num_blocks, block_size, shape.num_kv_heads, shape.head_dim),
                                   dtype, device)
        return cls(key=list(both[0].unbind()), value=list(both[1].unbind()))


class LlamaModel:
    def __init__(self, shape: ModelShape, weights: ModelWeights, rotary: dict[str, RotaryEmbedding],
                 backend: kernels.Backend, features: ModelFeatures) -> None:
        self.backend = backend
        self.shape = shape
        self.weights = weights
        self.rotary = rotary  # by the keys of `features.layer_rope`
        self.features = features
        # Gemma rounds its scale to the model's dtype first (a tensor); Granite's multiplier is a float.
        self.embedding_scale: torch.Tensor | float = features.embedding_scale
        if features.spec.scaled_embedding:
            self.embedding_scale = torch.tensor(features.embedding_scale, dtype=self.dtype,
                                                device=weights.final_norm.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.final_norm.dtype

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.weights.embed_tokens
        if isinstance(table, torch.Tensor):
            return F.embedding(input_ids, table)
        return (self.weights.lm_head if table is None else table).rows(input_ids, self.dtype)

    def rope_variant(self, num_tokens: int) -> str | None:
        """What the cached keys of a request of `num_tokens` tokens depend on beyond its tokens and
        adapter (`models.rope`)."""
        return rope_variant(self.rotary, num_tokens)

    @property
    def recompute_length(self) -> int | None:
        """A request growing past this many tokens recomputes its whole cache (`models.rope`)."""
        return recompute_length(self.rotary)

    def forward(self, batch: ForwardBatch, kv_cache: KVCacheTensors) -> torch.Tensor:
        """Run one step; returns logits `[num_logit_rows, vocab]` for `batch.logits_indices`, in the
        model's dtype (HF's bf16 logits are these same values; consumers widen to float32 where they
        compute, which for greedy decoding is inside the backend's `max_logsumexp`).

        The residual stream is kept apart from the normalised activations: each norm before a
        sublayer adds the last sublayer's output into the residual in place and normalises the sum
        in one fused op."""
        layers = self.weights.layers
        residual = self._embed(batch.input_ids)  # [num_tokens, hidden]
        if self.features.embedding_scale != 1.0:
            residual = residual * self.embedding_scale
        x = self._norm(residual, layers[0].attention_in_norm) if layers[0].attention_in_norm is not None else residual
        rotary_rows = {key: rotary.rows(batch.positions, batch.request_lens) for key, rotary in self.rotary.items()}
        for layer_idx, layer in enumerate(layers):
            attended = self._attention(layer_idx, layer, x, batch, kv_cache, rotary_rows)
            attended = self._sublayer_out(attended, layer.attention_out_norm)
            x = self._add_and_norm(attended, residual, layer.mlp_in_norm)
            mlp_out = self._sublayer_out(self._mlp(layer_idx, layer, x, batch), layer.mlp_out_norm)
            is_last = layer_idx + 1 == len(layers)
            next_norm = self.weights.final_norm if is_last else layers[layer_idx + 1].attention_in_norm
            x = self._add_and_norm(mlp_out, residual, next_norm)
        return self._logits(x.index_select(0, batch.logits_indices))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, weight, self.shape.rms_norm_eps)

    def _sublayer_out(self, y: torch.Tensor, out_norm: torch.Tensor | None) -> torch.Tensor:
        """A sublayer's output as the residual adds it: normalised (Gemma, OLMo 2), scaled (Granite)."""
        if out_norm is not None:
            y = self._norm(y, out_norm)
        if self.features.residual_multiplier != 1.0:
            y.mul_(self.features.residual_multiplier)
        return y

    def _add_and_norm(self, y: torch.Tensor, residual: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """residual += y in place; the next sublayer's input: the sum normalised, or (OLMo 2) a copy of it."""
        if norm is None:
            return residual.add_(y).clone()
        return self.backend.rms_norm(y, norm, self.shape.rms_norm_eps, residual=residual)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.weights.lm_head(x)
        if self.features.logits_divisor != 1.0:
            logits.div_(self.features.logits_divisor)
        if self.features.final_softcap is not None:
            cap = self.features.final_softcap
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits

    def _attention(
        self, layer_idx: int, layer: LayerWeights, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCacheTensors,
        rotary_rows: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """`rotary_rows`: each token's row of each rotary table `[num_tokens]`, by table key."""
        shape, features = self.shape, self.features
        key_cache, value_cache = kv_cache.key[layer_idx], kv_cache.value[layer_idx]
        cache_reads = self.backend.attention_reads(key_cache, value_cache, batch.attention)
        qkv = self._project(layer_idx, "qkv", x, layer.qkv, batch, cache_reads)
        if layer.q_norm is not None:
            self._norm_qk(qkv, layer)
        rope_key = features.layer_rope[layer_idx]
        if rope_key is None:
            _, k, v = split_qkv(qkv, shape.num_heads, shape.num_kv_heads, shape.head_dim)
            self.backend.store_kv(k, v, key_cache, value_cache, batch.slot_mapping)
        else:
            rotary = self.rotary[rope_key]
            self.backend.rotary_store_kv(qkv, rotary_rows[rope_key], rotary.cos, rotary.sin, key_cache, value_cache,
                                         batch.slot_mapping, shape.num_heads, shape.num_kv_heads)
        q = qkv[:, : shape.q_size].unflatten(-1, (shape.num_heads, shape.head_dim))
        attended = self.backend.paged_attention(q, key_cache, value_cache, batch.attention, features.attention_scale,
                                                window=features.layer_windows[layer_idx],
                                                softcap=features.attention_softcap)
        return self._project(layer_idx, "o", attended.reshape(x.shape[0], shape.q_size), layer.o, batch)

    def _norm_qk(self, qkv: torch.Tensor, layer: LayerWeights) -> None:
        """In place: RMS norm of q and of k, per head (Qwen3, Gemma 3) or over the whole projection
        (OLMo 2), the width of the norm's weight telling which."""
        shape = self.shape
        for start, width, weight in ((0, shape.q_size, layer.q_norm), (shape.q_size, shape.kv_size, layer.k_norm)):
            part = qkv[:, start : start + width]
            rows = part.reshape(-1, weight.shape[0])  # a copy: the slice's rows are not contiguous
            part.copy_(self._norm(rows, weight).view_as(part))

    def _mlp(self, layer_idx: int, layer: LayerWeights, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        gate_up = self._project(layer_idx, "gate_up", x, layer.gate_up, batch)
        if self.features.activation == "silu":
            hidden = self.backend.silu_and_mul(gate_up)
        else:
            hidden = self.backend.gelu_tanh_and_mul(gate_up)
        return self._project(layer_idx, "down", hidden, layer.down, batch)

    @staticmethod
    def _project(layer_idx: int, projection: str, x: torch.Tensor, linear: LinearWeight, batch: ForwardBatch,
                 reads: Reads = NO_READS) -> torch.Tensor:
        """The projection, and its adapters' deltas; its matmul requests what the op after the
        projection reads (`reads`) while it computes."""
        y = linear(x, reads)
        if batch.lora is not None:
            batch.lora.apply(layer_idx, projection, y, x)
        return y
