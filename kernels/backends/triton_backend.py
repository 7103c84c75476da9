"""The Triton backend: the SGMV/BGMV LoRA kernels, the paged-attention kernels and the matmul over
quantized blocks on CUDA (or on CPU tensors under the Triton interpreter, `TRITON_INTERPRET=1`, which
is how CI runs them), and the PyTorch backend's ops for the rest (cuBLAS matmuls, elementwise ops)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kernels.attention.plans import StepSequences, TritonAttentionPlan
from kernels.backends.torch_backend import TorchBackend
from kernels.lora.layouts import LoraLayout, ModuleShape, RowPages
from kernels.lora.plans import LoraSlice, PageTable, TritonLoraPlan
from kernels.quantized import QuantizedWeight


class TritonBackend(TorchBackend):
    name = "triton"

    def __init__(self, device: torch.device) -> None:
        # Imported here, not at the top: triton is an optional dependency of CPU-only installs.
        from kernels.triton_utils import is_interpreter

        if device.type != "cuda" and not is_interpreter():
            # Launched on CPU outside the interpreter Triton fails with "0 active drivers".
            raise RuntimeError("the Triton backend on CPU tensors needs the Triton interpreter: set "
                               "TRITON_INTERPRET=1 before kernels is imported")
        super().__init__(device)

    def linear(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None):
        """A quantized weight through the Triton matmul over its blocks (kernels/quantized_matmul.py),
        dequantized inside the kernel; a dense one through cuBLAS."""
        if isinstance(weight, QuantizedWeight):
            from kernels.quantized_matmul import TritonQuantizedLinear

            return TritonQuantizedLinear(weight, bias, self.device)
        return super().linear(weight, bias)

    def lora_layout(self, model_dtype: torch.dtype, shapes: Sequence[ModuleShape]) -> LoraLayout:
        return RowPages(model_dtype)

    def plan_attention(self, step: StepSequences) -> TritonAttentionPlan:
        return TritonAttentionPlan.build(step, self.device)

    def paged_attention(self, q, k_cache, v_cache, plan: TritonAttentionPlan, scale: float, window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
        # Imported on first use: triton is an optional dependency of CPU-only installs.
        from kernels.attention.triton_ops import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, plan, scale, window, softcap)

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        from kernels.attention.triton_ops import store_kv_triton

        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)

    def plan_lora(self, layout: LoraLayout, token_entries: Sequence[int], tables: Mapping[str, PageTable]) -> TritonLoraPlan:
        return TritonLoraPlan.build(token_entries, tables, self.device)

    def add_lora(self, y, x, slices: Sequence[LoraSlice], plan: TritonLoraPlan) -> None:
        from kernels.lora.triton_ops import add_lora_triton

        add_lora_triton(y, x, slices, plan)
