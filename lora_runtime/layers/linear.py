"""A linear projection whose weight is laid out once for the fastest matmul of its device.

On CPU in bf16, oneDNN's prepacked weights (the layout PyTorch's own CPU compiler uses) ran the
projections 1.3-2x faster than `F.linear` on the same tensors, with identical results (measured for
1-300 rows at the SmolLM2 shapes). Bias-free bf16 projections take the kernel library's compiled
matmul (`kernels.linear_packed`) where the CPU has one: on AMX CPUs for decode-sized batches (oneDNN
is faster above them and keeps a packed copy for those), on AVX512-BF16 CPUs without AMX for every
batch. Everything else takes the plain `F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels

# Row count the oneDNN packed layout is tuned for: a typical decode step of the default scheduler.
_PACKING_BATCH_HINT = 64


def _can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class Linear:
    """y = x @ weight.T + bias, with `weight` `[out_features, in_features]`.

    Holds the weight only in the forms its calls use: the compiled kernel's layout and oneDNN's
    packing where they apply, and then not the plain tensor as well (it would be a third copy of
    every projection)."""

    __slots__ = ("bias", "_weight", "_compiled", "_packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self._compiled = kernels.pack_linear_weight(weight) if bias is None else None
        serves_all = self._compiled is not None and self._compiled.max_rows is None
        self._packed = None
        if not serves_all and _can_prepack(weight):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_BATCH_HINT)
        self._weight = weight if self._packed is None and not serves_all else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        compiled = self._compiled
        if compiled is not None and (compiled.max_rows is None or x.shape[0] <= compiled.max_rows):
            return kernels.linear_packed(x, compiled)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self._weight, self.bias)
