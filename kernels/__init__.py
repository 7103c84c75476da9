"""Tensor ops of the serving stack: multi-adapter LoRA (SGMV/BGMV) and paged attention.

Pure tensor functions with no knowledge of requests or adapters' names. CUDA tensors run the
Triton kernels, CPU tensors the compiled CPU ops or the fastest PyTorch path; `kernels.reference`
holds the plain twins. Also the fused per-token ops of the decoder block (norms, SiLU-and-multiply,
rotary + KV write), the sampler's max/logsumexp, compiled on CPU and plain PyTorch elsewhere, and
compiled bf16 matmuls for the projections on CPUs with AMX or AVX512-BF16."""
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
from kernels.linear import PackedLinear, linear_packed, pack_linear_weight
from kernels.lora.meta import LoraBatchMeta

__all__ = [
    "LoraBatchMeta",
    "PackedLinear",
    "PagedAttentionMeta",
    "add_lora",
    "linear_packed",
    "max_logsumexp",
    "pack_linear_weight",
    "paged_attention",
    "rms_norm",
    "rotary_store_kv",
    "silu_and_mul",
    "store_kv",
]
