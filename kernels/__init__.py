"""Tensor ops of the serving stack: multi-adapter LoRA (SGMV/BGMV) and paged attention.

Pure tensor functions with no knowledge of requests or adapters' names. CUDA tensors run the
Triton kernels, CPU tensors the fastest PyTorch path; `kernels.reference` holds the plain twins."""
from kernels.attention.meta import PagedAttentionMeta
from kernels.dispatch import add_lora, paged_attention, store_kv
from kernels.lora.meta import LoraBatchMeta

__all__ = ["LoraBatchMeta", "PagedAttentionMeta", "add_lora", "paged_attention", "store_kv"]
