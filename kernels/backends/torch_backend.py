"""The PyTorch backend: plain PyTorch ops, for CPUs without the compiled ops and for devices that
are neither CUDA nor CPU. Each op is the fastest plain-PyTorch form we measured, not the reference:
`kernels.reference` is the tests' oracle and is only called here where it is already that form
(norms, SiLU-and-multiply, the rotary embedding)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kernels import reference
from kernels.attention.plans import StepSequences, TorchAttentionPlan
from kernels.attention.torch_ops import paged_attention_torch, store_kv_torch
from kernels.linear import NO_READS, DequantizingLinear, PlainLinear, Reads
from kernels.quantized import QuantizedWeight
from kernels.lora.layouts import LoraLayout, ModuleShape, RowPages
from kernels.lora.plans import LoraSlice, PageTable, TorchLoraPlan
from kernels.lora.torch_ops import add_lora_torch


class TorchBackend:
    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def label(self) -> str:
        """The backend's name, and where it has several kernel forms the one in use ("cpu/avx2")."""
        return self.name

    def lora_layout(self, model_dtype: torch.dtype, shapes: Sequence[ModuleShape]) -> LoraLayout:
        # Tiny 16-bit matmuls cost 2-5x more than float32 ones on CPU (measured with the segment loop).
        return RowPages(torch.float32 if self.device.type == "cpu" else model_dtype)

    def linear(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None, *,
               few_rows: bool = False):
        """A projection in this backend's form; `few_rows` (the head) matters only where a backend holds
        a second form for large batches (the compiled CPU backend)."""
        if isinstance(weight, QuantizedWeight):
            return DequantizingLinear(weight, bias)
        return PlainLinear(weight, bias)

    def plan_attention(self, step: StepSequences) -> TorchAttentionPlan:
        return TorchAttentionPlan.build(step)

    def paged_attention(self, q, k_cache, v_cache, plan: TorchAttentionPlan, scale: float, window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
        return paged_attention_torch(q, k_cache, v_cache, plan, scale, window, softcap)

    def attention_reads(self, k_cache, v_cache, plan) -> Reads:
        """What `paged_attention` will read, for the projection before it to request (`kernels.linear`):
        nothing here, whose matmuls do not take reads."""
        return NO_READS

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        store_kv_torch(k, v, k_cache, v_cache, slot_mapping)

    def rotary_store_kv(self, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads) -> None:
        reference.rotate_qk(qkv, positions, cos, sin, num_heads, num_kv_heads)
        _, k, v = reference.split_qkv(qkv, num_heads, num_kv_heads, k_cache.shape[-1])
        self.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def rms_norm(self, x, weight, eps: float, residual=None) -> torch.Tensor:
        return reference.rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return reference.silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return reference.gelu_tanh_and_mul(gate_up)

    def max_logsumexp(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = scores.float()
        values, indices = scores.max(dim=-1)
        # Reusing the maxima: one exp-sum pass, about half the cost of a separate logsumexp.
        return values, indices, values + (scores - values[:, None]).exp_().sum(dim=-1).log_()

    def plan_lora(self, layout: LoraLayout, token_entries: Sequence[int], tables: Mapping[str, PageTable]) -> TorchLoraPlan:
        return TorchLoraPlan.build(token_entries, tables, self.device)

    def add_lora(self, y, x, slices: Sequence[LoraSlice], plan: TorchLoraPlan) -> None:
        add_lora_torch(y, x, slices, plan)
