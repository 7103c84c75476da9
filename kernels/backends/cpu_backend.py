"""The compiled CPU backend: the ops of `kernels/csrc/` in the best instruction-set form this CPU
runs (`kernels.cpu_ops`), and the PyTorch backend's paths where an op does not apply (the prefills
too long for the compiled attention, tensors it does not take)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType

import torch

from kernels.attention.plans import CompiledAttentionPlan, StepSequences
from kernels.attention.torch_ops import attend_prefill
from kernels.backends.torch_backend import TorchBackend
from kernels.linear import NO_READS, CompiledLinear, QuantizedLinear, Reads, pack_linear_weight
from kernels.lora.layouts import LoraLayout, ModuleShape, TiledPages
from kernels.lora.plans import CompiledLoraPlan, LoraSlice, PageTable, TorchLoraPlan
from kernels.quantized import QuantizedWeight

_COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CompiledCPUBackend(TorchBackend):
    name = "cpu"

    def __init__(self, device: torch.device, ops: ModuleType) -> None:
        super().__init__(device)
        self.ops = ops

    @property
    def label(self) -> str:
        return f"{self.name}/{self.ops.active_form()}"

    def lora_layout(self, model_dtype: torch.dtype, shapes: Sequence[ModuleShape]) -> LoraLayout:
        """The compiled op's tiled pages: bf16 for a bf16 model (PEFT's own precision for it; half the
        bytes to read per step), float32 otherwise; the PyTorch backend's row pages where a module's
        outputs are not whole blocks of 16 columns."""
        dtype = torch.bfloat16 if model_dtype == torch.bfloat16 else torch.float32
        if all(TiledPages.fits(shape, dtype) for shape in shapes):
            return TiledPages(dtype)
        return super().lora_layout(model_dtype, shapes)

    def linear(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None, *,
               few_rows: bool = False):
        """`few_rows`: the projection sees a step's sampled rows only (the head), so it is held in the
        compiled form alone: oneDNN's second copy for batches past the compiled kernel's `max_rows`
        would go unused and, for a 128k-vocabulary head, cost ~500 MB (the compiled form serves any
        number of rows, slower past `max_rows`)."""
        if isinstance(weight, QuantizedWeight):
            return QuantizedLinear(weight, bias)
        packed = pack_linear_weight(weight) if bias is None else None
        if packed is None:
            return super().linear(weight, bias)
        return CompiledLinear(packed, weight, large_batches=not few_rows)

    def plan_attention(self, step: StepSequences) -> CompiledAttentionPlan:
        return CompiledAttentionPlan.build(step, self.ops.has_vector_attention())

    def paged_attention(self, q, k_cache, v_cache, plan: CompiledAttentionPlan, scale: float, window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        if plan.compiled_seqs is not None:
            self.ops.paged_attention(q, k_cache, v_cache, plan.block_tables, plan.seq_lens, plan.query_start,
                                     plan.compiled_seqs, scale, out, window or 0, softcap or 0.0)
        for prefill in plan.prefills:
            attend_prefill(q, k_cache, v_cache, prefill, scale, out, window, softcap)
        return out

    def attention_reads(self, k_cache, v_cache, plan: CompiledAttentionPlan) -> Reads:
        if not k_cache.is_contiguous() or not v_cache.is_contiguous():
            return NO_READS
        return Reads((k_cache, v_cache), (plan.blocks_read, plan.blocks_read))

    def rotary_store_kv(self, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads) -> None:
        # The compiled op rotates whole heads; a partial rotary (Phi-3/4) takes the PyTorch form.
        if _same_dtype(qkv, cos, sin, k_cache, v_cache) and cos.shape[1] == k_cache.shape[-1]:
            self.ops.rotary_store_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
        else:
            super().rotary_store_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)

    def rms_norm(self, x, weight, eps: float, residual=None) -> torch.Tensor:
        if not _rows_of_one_dtype(x, weight, *(() if residual is None else (residual,))):
            return super().rms_norm(x, weight, eps, residual)
        out = torch.empty_like(x)
        if residual is None:
            self.ops.rms_norm(out, x, weight, eps)
        else:
            self.ops.add_rms_norm(out, x, residual, weight, eps)
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not _rows_of_one_dtype(gate_up):
            return super().silu_and_mul(gate_up)
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self.ops.silu_and_mul(out, gate_up)
        return out

    def max_logsumexp(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not _rows_of_one_dtype(scores) or scores.shape[1] == 0:
            return super().max_logsumexp(scores)
        rows = scores.shape[0]
        values, log_normaliser = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.float32)
        indices = torch.empty(rows, dtype=torch.int64)
        self.ops.max_logsumexp(scores, values, indices, log_normaliser)
        return values, indices, log_normaliser

    def plan_lora(self, layout: LoraLayout, token_entries: Sequence[int],
                  tables: Mapping[str, PageTable]) -> CompiledLoraPlan | TorchLoraPlan:
        """The compiled op's plan for tiled pages, the PyTorch loop's for row pages (`lora_layout`)."""
        if isinstance(layout, TiledPages):
            return CompiledLoraPlan.build(token_entries, tables)
        return super().plan_lora(layout, token_entries, tables)

    def add_lora(self, y, x, slices: Sequence[LoraSlice], plan: CompiledLoraPlan | TorchLoraPlan) -> None:
        if isinstance(plan, TorchLoraPlan):
            super().add_lora(y, x, slices, plan)
        elif plan.num_segments:
            self.ops.lora_segments(y, x.contiguous(), plan.segment_table, [piece.a for piece in slices],
                                   [piece.b for piece in slices], [plan.ranks[piece.module] for piece in slices],
                                   [plan.page_tables[piece.module] for piece in slices],
                                   [piece.start for piece in slices])


def _rows_of_one_dtype(first: torch.Tensor, *others: torch.Tensor) -> bool:
    """The compiled per-row ops take contiguous CPU tensors of one float dtype."""
    return (first.dtype in _COMPILED_DTYPES and first.is_contiguous()
            and all(t.dtype == first.dtype and t.is_contiguous() for t in others))


def _same_dtype(*tensors: torch.Tensor) -> bool:
    return tensors[0].dtype in _COMPILED_DTYPES and all(t.dtype == tensors[0].dtype for t in tensors)
