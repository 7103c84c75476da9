"""Tiny GGUF files for tests, written with gguf's own `GGUFWriter` as llama.cpp's converter lays them
out: the family's metadata, the embedded model's tokenizer and chat template, F32 norms, and
projections either quantized by gguf from a Hugging Face model of the family (named by gguf's own
tensor name map, with the converter's changes: a Llama's q/k rows permuted into llama.cpp's rotary
layout, Gemma's norms stored as 1 + w) or random valid blocks of any type (Llama's names)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFReader, GGUFWriter, RopeScalingType, get_tensor_name_map

from lora_runtime.embedded import gguf_path
from tests.kernels.quant_blocks import quantized_by_gguf, random_blocks

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
                  "tokenizer.chat_template")
VOCAB_SIZE = 49152  # the embedded tokenizer's
# The embedded tokenizer's first tokens: its BPE merge i makes token FIRST_MERGED + i, so its first
# n tokens with their merges are a whole BPE of n tokens (files of a smaller vocab_size).
FIRST_MERGED = 252
# A vocab_size for files that need no more: tests' prompts' ids reach 1,005 (reading the whole 49k
# tokens and merges took the engine ~22 s and transformers ~16 s a file on a busy 2-core machine).
CUT_VOCAB_SIZE = 1280
# llama.cpp's names of a Llama layer's projections (random_tensors).
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class TinyDims:
    hidden_size: int = 64
    intermediate_size: int = 96
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 256
    architecture: str = "llama"  # general.architecture: llama, qwen3, gemma3, phi3
    head_size: int | None = None  # None: hidden_size // num_heads
    sliding_window: int | None = None  # gemma3's, written to the file
    rope_scaling_factor: float | None = None  # linear RoPE scaling written to the file (transformers reads none)
    # Below VOCAB_SIZE: the embedded tokenizer cut to its first vocab_size tokens (CUT_VOCAB_SIZE).
    vocab_size: int = VOCAB_SIZE

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    def hf_config(self):
        """A config of the family that says only what the file's metadata carries (transformers
        rebuilds the rest from its defaults when it reads the file)."""
        import transformers

        config_class, extra = FAMILY_CONFIGS[self.architecture]
        if self.head_size is not None:
            extra = extra | {"head_dim": self.head_size}
        if self.sliding_window is not None:
            extra = extra | {"sliding_window": self.sliding_window}
        return getattr(transformers, config_class)(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, max_position_embeddings=self.max_position_embeddings,
            rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, **extra)

    def projection_shape(self, name: str) -> tuple[int, int]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        hidden, mlp = self.hidden_size, self.intermediate_size
        return {"attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden), "attn_output": (hidden, q),
                "ffn_gate": (mlp, hidden), "ffn_up": (mlp, hidden), "ffn_down": (hidden, mlp)}[name]


# general.architecture -> (transformers' config class, what the family's config needs beyond the
# shape). Qwen3's GGUF config reader keeps the class's head_dim (128) whatever the file says: files
# of it need head_size=128. Gemma 3 files hold the text model, with tied embeddings as Gemma's are.
FAMILY_CONFIGS = {"llama": ("LlamaConfig", {"tie_word_embeddings": False}),
                  "qwen3": ("Qwen3Config", {"tie_word_embeddings": False}),
                  "gemma3": ("Gemma3TextConfig", {"tie_word_embeddings": True}),
                  "phi3": ("Phi3Config", {"tie_word_embeddings": False, "pad_token_id": 2})}
GGUF_ARCHS = {"llama": MODEL_ARCH.LLAMA, "qwen3": MODEL_ARCH.QWEN3, "gemma3": MODEL_ARCH.GEMMA3,
              "phi3": MODEL_ARCH.PHI3}

# The f16 scale of each type that gives random blocks weights of about 0.05 at most: the scale times
# the largest sub-block scale and quant it multiplies (Q4_K: 63 * 15; Q6_K: 127 * 32).
RANDOM_SCALES = {"Q8_0": 4e-4, "Q4_0": 6e-3, "Q4_1": 3e-3, "Q4_K": 5e-5, "Q5_K": 2.5e-5, "Q6_K": 1.2e-5}

Tensor = tuple[str, np.ndarray]  # (GGML type name, data: float32 values, or the block bytes [rows, row_bytes])


def rotary_permuted(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter's layout of q/k rows: within each head, (half, pair) -> (pair, half)."""
    per_head = weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


def tensors_from_hf(model, dims: TinyDims, type_name: str) -> dict[str, Tensor]:
    """A HF model's weights as llama.cpp's converter would write them for `dims.architecture`, named
    by gguf's tensor name map, every matrix quantized to `type_name` (or kept in "F32"), the head left
    out when tied."""
    name_map = get_tensor_name_map(GGUF_ARCHS[dims.architecture], dims.num_layers)
    tensors: dict[str, Tensor] = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        module, suffix = hf_name.rsplit(".", 1)
        name = f"{name_map.get_name(module)}.{suffix}"
        weight = _as_converted(dims, name, tensor.detach().float())
        tensors[name] = (("F32", weight.numpy()) if weight.dim() == 1 or type_name == "F32"
                         else (type_name, quantized_by_gguf(type_name, weight).data.numpy()))
    return tensors


def _as_converted(dims: TinyDims, name: str, weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's converter's changes: a Llama's q/k rows permuted, Gemma's norms stored as 1 + w."""
    if dims.architecture == "llama" and (".attn_q." in name or ".attn_k." in name):
        return rotary_permuted(weight, dims.num_heads if ".attn_q." in name else dims.num_kv_heads)
    if dims.architecture == "gemma3" and name.endswith("norm.weight"):
        return weight + 1
    return weight


def random_tensors(dims: TinyDims, types: dict[str, str], seed: int = 0) -> dict[str, Tensor]:
    """Random valid blocks of `types[name]` for every projection (and "token_embd", "output")."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, Tensor] = {}
    for name in ("token_embd", "output"):
        blocks = random_blocks(types[name], dims.vocab_size, dims.hidden_size, seed=seed,
                               scale=RANDOM_SCALES[types[name]])
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


def write_gguf(path: Path, dims: TinyDims, tensors: dict[str, Tensor], architecture: str | None = None) -> Path:
    """`architecture`: general.architecture when not `dims.architecture` (files of unknown ones)."""
    writer = GGUFWriter(str(path), architecture or dims.architecture)
    writer.add_block_count(dims.num_layers)
    writer.add_context_length(dims.max_position_embeddings)
    writer.add_embedding_length(dims.hidden_size)
    writer.add_feed_forward_length(dims.intermediate_size)
    writer.add_head_count(dims.num_heads)
    writer.add_head_count_kv(dims.num_kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(dims.head_dim)
    writer.add_vocab_size(dims.vocab_size)
    if dims.head_size is not None:
        writer.add_key_length(dims.head_size)
        writer.add_value_length(dims.head_size)
    if dims.sliding_window is not None:
        writer.add_sliding_window(dims.sliding_window)
    if dims.rope_scaling_factor is not None:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(dims.rope_scaling_factor)
    _copy_tokenizer(writer, dims.vocab_size)
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


def _copy_tokenizer(writer: GGUFWriter, vocab_size: int) -> None:
    """The embedded model's tokenizer and chat template, field by field, cut to `vocab_size` tokens."""
    kept = {"tokenizer.ggml.tokens": vocab_size, "tokenizer.ggml.token_type": vocab_size,
            "tokenizer.ggml.merges": vocab_size - FIRST_MERGED}
    for key, (value, value_type, sub_type) in _tokenizer_fields().items():
        writer.add_key_value(key, value[:kept[key]] if key in kept else value, value_type, sub_type=sub_type)


@functools.cache
def _tokenizer_fields() -> dict:
    fields = GGUFReader(gguf_path()).fields
    return {key: (fields[key].contents(), fields[key].types[0], fields[key].types[-1] if len(fields[key].types) > 1
                  else None) for key in TOKENIZER_KEYS}


def random_hf_model(dims: TinyDims, seed: int):
    """A random transformers model of `dims`' family, its norms (1-D weights) drawn around their
    initial values, so that a file whose norms are read wrong cannot match."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(dims.hf_config()).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.2 * torch.randn_like(parameter))
    return model
