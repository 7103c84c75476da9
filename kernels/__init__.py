"""Tensor ops of the serving stack: multi-adapter LoRA (SGMV/BGMV) and paged attention.

Pure tensor functions with no knowledge of requests or adapters' names. CUDA tensors run the
Triton kernels, CPU tensors the compiled CPU ops or the fastest PyTorch path; `kernels.reference`
holds the plain twins. Also the fused per-token ops of the decoder block (norms, SiLU-and-multiply,
rotary + KV write) and the sampler's max/logsumexp, compiled on CPU and plain PyTorch elsewhere."""
from kernels.attention.meta import PagedAttentionMeta
from kernels.dispatch import (
    add_lora,
    max_logsumexp,
    paged_attention,
    rms_norm,
    rotary_store_kv,
    silu_and_mul,
    store_kv,
)
from kernels.lora.meta import LoraBatchMeta

__all__ = [
    "LoraBatchMeta",
    "PagedAttentionMeta",
    "add_lora",
    "max_logsumexp",
    "paged_attention",
    "rms_norm",
    "rotary_store_kv",
    "silu_and_mul",
    "store_kv",
]
