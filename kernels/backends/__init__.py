"""One backend per device, chosen once: `backend_for(device)`.

- CUDA: `TritonBackend` (the SGMV/BGMV and paged-attention Triton kernels).
- CPU: `CompiledCPUBackend` where the compiled CPU ops are installed and this CPU runs one of their
  forms (`kernels.cpu_ops`), else `TorchBackend`.
- Any other device: `TorchBackend`.

Every backend offers the same ops, and each op's per-step plan is built by the backend that runs it
(`plan_attention`, `plan_lora`), so a step carries only its own backend's metadata:

    linear(weight, bias=None) -> callable (x [M, in], reads=NO_READS) -> [M, out]; `reads`: the pages the
        op after the projection reads, which the compiled matmuls fetch while they compute
    attention_reads(k_cache, v_cache, plan) -> those reads of attention (NO_READS where the backend's
        matmuls take none)
    lora_layout(model_dtype, module_shapes) -> what a page of the adapter pool holds (kernels.lora.layouts)
    plan_attention(StepSequences) -> plan;  paged_attention(q, k_cache, v_cache, plan, scale, window=None,
        softcap=None) -> out: causal, or over the last `window` positions; scores soft-capped where given
    store_kv(k, v, k_cache, v_cache, slot_mapping);  rotary_store_kv(qkv, positions, cos, sin,
        k_cache, v_cache, slot_mapping, num_heads, num_kv_heads): cos/sin [rows, R], R <= head_dim
        rotated, `positions` each token's row
    rms_norm(x, weight, eps, residual=None);  silu_and_mul(gate_up);  gelu_tanh_and_mul(gate_up);  max_logsumexp(scores)
    plan_lora(layout, token_entries, page_tables) -> plan;  add_lora(y, x, slices, plan): y[:, slice columns]
        += each token's adapter delta, its pages found through the plan (kernels.lora.plans)

Semantics, shapes and roundings of each op: its twin in `kernels.reference`, the tests' oracle.
"""
from __future__ import annotations

import functools

import torch

from kernels import cpu_ops
from kernels.backends.cpu_backend import CompiledCPUBackend
from kernels.backends.torch_backend import TorchBackend
from kernels.backends.triton_backend import TritonBackend

Backend = TorchBackend | CompiledCPUBackend | TritonBackend
BACKEND_NAMES = ("triton", "cpu", "torch")


def backend_for(device: torch.device | str, name: str | None = None) -> Backend:
    """The backend of `device` (None: chosen by the device, as above), or the one named: "triton"
    (CUDA, or CPU under TRITON_INTERPRET=1), "cpu" (the compiled CPU ops) or "torch"."""
    return _backend(torch.device(device), name)


@functools.cache
def _backend(device: torch.device, name: str | None) -> Backend:
    if name is None:
        name = "triton" if device.type == "cuda" else "cpu" if device.type == "cpu" and cpu_ops.ops() else "torch"
    if name == "triton":
        return TritonBackend(device)
    if name == "cpu":
        ops = cpu_ops.ops()
        if device.type != "cpu" or ops is None:
            raise RuntimeError(f"the compiled CPU backend needs a CPU device and the compiled ops ({device})")
        return CompiledCPUBackend(device, ops)
    if name == "torch":
        return TorchBackend(device)
    raise ValueError(f"backend must be one of {BACKEND_NAMES} or None, got {name!r}")
