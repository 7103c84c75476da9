"""Tiny GGUF files for tests, written with gguf's own `GGUFWriter` as llama.cpp's converter lays them
out: llama metadata, the embedded model's tokenizer and chat template, F32 norms, and projections
either quantized by gguf from a Hugging Face model (q/k rows permuted into llama.cpp's rotary layout)
or random valid blocks of any type."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from lora_runtime.embedded import gguf_path
from tests.kernels.quant_blocks import quantized_by_gguf, random_blocks

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
                  "tokenizer.chat_template")
VOCAB_SIZE = 49152  # the embedded tokenizer's
# Our name of each projection -> llama.cpp's, and HF's.
PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


@dataclass(frozen=True)
class TinyDims:
    hidden_size: int = 64
    intermediate_size: int = 96
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 256

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def hf_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size,
                           num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
                           num_key_value_heads=self.num_kv_heads, max_position_embeddings=self.max_position_embeddings,
                           rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

    def projection_shape(self, name: str) -> tuple[int, int]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        hidden, mlp = self.hidden_size, self.intermediate_size
        return {"attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden), "attn_output": (hidden, q),
                "ffn_gate": (mlp, hidden), "ffn_up": (mlp, hidden), "ffn_down": (hidden, mlp)}[name]


# The f16 scale of each type that gives random blocks weights of about 0.05 at most: the scale times
# the largest sub-block scale and quant it multiplies (Q4_K: 63 * 15; Q6_K: 127 * 32).
RANDOM_SCALES = {"Q8_0": 4e-4, "Q4_0": 6e-3, "Q4_1": 3e-3, "Q4_K": 5e-5, "Q5_K": 2.5e-5, "Q6_K": 1.2e-5}

Tensor = tuple[str, np.ndarray]  # (GGML type name, data: float32 values, or the block bytes [rows, row_bytes])


def rotary_permuted(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter's layout of q/k rows: within each head, (half, pair) -> (pair, half)."""
    per_head = weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


def tensors_from_hf(model, dims: TinyDims, type_name: str) -> dict[str, Tensor]:
    """A HF Llama's weights as llama.cpp would write them, every matrix quantized to `type_name`."""
    state = {name: tensor.detach().float() for name, tensor in model.state_dict().items()}

    def quantized(weight: torch.Tensor) -> Tensor:
        return type_name, quantized_by_gguf(type_name, weight).data.numpy()

    tensors = {"token_embd.weight": quantized(state["model.embed_tokens.weight"]),
               "output_norm.weight": ("F32", state["model.norm.weight"].numpy()),
               "output.weight": quantized(state["lm_head.weight"])}
    for idx in range(dims.num_layers):
        hf, ours = f"model.layers.{idx}.", f"blk.{idx}."
        tensors[ours + "attn_norm.weight"] = "F32", state[hf + "input_layernorm.weight"].numpy()
        tensors[ours + "ffn_norm.weight"] = "F32", state[hf + "post_attention_layernorm.weight"].numpy()
        for name, hf_name in PROJECTIONS.items():
            weight = state[hf + hf_name + ".weight"]
            if name in ("attn_q", "attn_k"):
                weight = rotary_permuted(weight, dims.num_heads if name == "attn_q" else dims.num_kv_heads)
            tensors[ours + name + ".weight"] = quantized(weight)
    return tensors


def random_tensors(dims: TinyDims, types: dict[str, str], seed: int = 0) -> dict[str, Tensor]:
    """Random valid blocks of `types[name]` for every projection (and "token_embd", "output")."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, Tensor] = {}
    for name, shape in (("token_embd", (VOCAB_SIZE, dims.hidden_size)), ("output", (VOCAB_SIZE, dims.hidden_size))):
        blocks = random_blocks(types[name], *shape, seed=seed, scale=RANDOM_SCALES[types[name]])
        tensors[name + ".weight"] = types[name], blocks.data.numpy()
    tensors["output_norm.weight"] = "F32", (1 + 0.1 * torch.randn(dims.hidden_size, generator=generator)).numpy()
    for idx in range(dims.num_layers):
        for norm in ("attn_norm", "ffn_norm"):
            norm_weight = 1 + 0.1 * torch.randn(dims.hidden_size, generator=generator)
            tensors[f"blk.{idx}.{norm}.weight"] = "F32", norm_weight.numpy()
        for offset, name in enumerate(PROJECTIONS):
            blocks = random_blocks(types[name], *dims.projection_shape(name), seed=seed + 100 * idx + offset,
                                   scale=RANDOM_SCALES[types[name]])
            tensors[f"blk.{idx}.{name}.weight"] = types[name], blocks.data.numpy()
    return tensors


def write_gguf(path: Path, dims: TinyDims, tensors: dict[str, Tensor], architecture: str = "llama") -> Path:
    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(dims.num_layers)
    writer.add_context_length(dims.max_position_embeddings)
    writer.add_embedding_length(dims.hidden_size)
    writer.add_feed_forward_length(dims.intermediate_size)
    writer.add_head_count(dims.num_heads)
    writer.add_head_count_kv(dims.num_kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(dims.head_dim)
    writer.add_vocab_size(VOCAB_SIZE)
    _copy_tokenizer(writer)
    for name, (type_name, data, *claimed_shape) in tensors.items():
        raw_dtype = None if type_name == "F32" else GGMLQuantizationType[type_name]
        # A third element: the shape the header claims, whatever `data` holds (corrupt files).
        raw_shape = claimed_shape[0] if claimed_shape else None
        writer.add_tensor(name, np.ascontiguousarray(data), raw_shape=raw_shape, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _copy_tokenizer(writer: GGUFWriter) -> None:
    """The embedded model's tokenizer and chat template, field by field."""
    for key, (value, value_type, sub_type) in _tokenizer_fields().items():
        writer.add_key_value(key, value, value_type, sub_type=sub_type)


@functools.cache
def _tokenizer_fields() -> dict:
    fields = GGUFReader(gguf_path()).fields
    return {key: (fields[key].contents(), fields[key].types[0], fields[key].types[-1] if len(fields[key].types) > 1
                  else None) for key in TOKENIZER_KEYS}
