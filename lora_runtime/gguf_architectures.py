"""How llama.cpp's converter writes each family we read from GGUF (by `general.architecture`): the
names under `blk.N.` of the tensors that make our fused projections and a layer's norms, and which
of its changes to undo. The model's shape and features come from transformers' GGUF config reader,
as for a Hugging Face checkpoint (`models/architectures.py`); this table is only the file's layout.

- llama (and Mistral, which llama.cpp writes as llama): q/k rows permuted into llama.cpp's rotary
  layout, undone here by whole rows (so by whole block rows, without dequantizing).
- qwen2, qwen3: not permuted; qwen3 adds the per-head q/k norms attn_q_norm and attn_k_norm.
- gemma3 (the text model): norms around both sublayers and per-head q/k norms, each stored as 1 + w,
  which is the plain scale our decoder multiplies by (the loader of a HF checkpoint folds it the
  same way), so read as stored.
- phi3 (Phi-3, Phi-4): q, k, v fused in attn_qkv and gate, up in ffn_up: our fused projections'
  rows as they are.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lora_runtime.models.architectures import ModelShape


@dataclass(frozen=True, slots=True)
class GGUFLayout:
    """One family's tensor names under `blk.N.` (None: the layer has no such norm)."""

    qkv: tuple[str, ...] = ("attn_q", "attn_k", "attn_v")  # stacked by rows into our qkv projection
    gate_up: tuple[str, ...] = ("ffn_gate", "ffn_up")  # stacked by rows into our gate_up projection
    attention_in_norm: str | None = "attn_norm"
    attention_out_norm: str | None = None
    mlp_in_norm: str | None = "ffn_norm"
    mlp_out_norm: str | None = None
    qk_norm: bool = False  # per-head attn_q_norm and attn_k_norm, [head_dim] each
    permuted_qk: bool = False  # q/k rows in llama.cpp's rotary layout


ARCHITECTURES: dict[str, GGUFLayout] = {
    "llama": GGUFLayout(permuted_qk=True),
    "qwen2": GGUFLayout(),
    "qwen3": GGUFLayout(qk_norm=True),
    "gemma3": GGUFLayout(attention_out_norm="post_attention_norm", mlp_out_norm="post_ffw_norm", qk_norm=True),
    "phi3": GGUFLayout(qkv=("attn_qkv",), gate_up=("ffn_up",)),
}
# Tensors of RoPE factors that neither transformers' GGUF reader nor we read: a file holding them
# (Phi-3's LongRoPE) is refused rather than served with plain RoPE. (Llama 3's rope_freqs.weight,
# which transformers ignores too, is left as before: Llama 3 files are served with plain RoPE.)
UNREAD_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def projection_rows(name: str, shape: ModelShape) -> int:
    """The rows of the tensor `name` (`blk.N.<kind>.weight` or `.bias`) of a qkv projection."""
    kind = name.split(".")[2]
    return {"attn_q": shape.q_size, "attn_k": shape.kv_size, "attn_v": shape.kv_size,
            "attn_qkv": shape.q_size + 2 * shape.kv_size}[kind]


def rotary_unpermutation(layout: GGUFLayout, name: str, num_rows: int, shape: ModelShape) -> torch.Tensor | None:
    """The row order that undoes llama.cpp's rotary permutation of the tensor `name`: within each
    head, its rows were reordered from (half, pair) to (pair, half). None where it was not permuted."""
    if not layout.permuted_qk or (".attn_q." not in name and ".attn_k." not in name):
        return None
    num_heads = shape.num_heads if ".attn_q." in name else shape.num_kv_heads
    return torch.arange(num_rows).view(num_heads, -1, 2).transpose(1, 2).reshape(-1)


def unread_metadata(architecture: str, metadata: Callable[[str], object | None], tensor_names: set[str],
                    head_dim: int) -> str | None:
    """Why the file asks for more than transformers' GGUF config reader (and so our model) takes
    from it, naming the key or tensor; None when it does not. Served regardless, such a file would
    run with plain RoPE over every dimension, or the wrong head size, and give wrong tokens quietly.
    `metadata`: a key's value, None where the file lacks it."""
    scaling = metadata(f"{architecture}.rope.scaling.type")
    if scaling not in (None, "none"):
        return (f"metadata key {architecture}.rope.scaling.type is {scaling!r}: RoPE scaling read from GGUF "
                f"is not supported")
    for key in (f"{architecture}.attention.key_length", f"{architecture}.rope.dimension_count"):
        value = metadata(key)
        if value is not None and int(value) != head_dim:
            return (f"metadata key {key} is {value}, where the config read from the file has head_dim "
                    f"{head_dim} (partial rotary or a head size the GGUF config reader does not take)")
    unread = sorted(tensor_names.intersection(UNREAD_TENSORS))
    if unread:
        return f"tensor {unread[0]} (LongRoPE factors) is not supported"
    return None
