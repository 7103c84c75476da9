"""A linear projection whose weight is laid out once for the fastest matmul of its device.

On CPU in bf16, oneDNN's prepacked weights (the layout PyTorch's own CPU compiler uses) ran the
projections 1.3-2x faster than `F.linear` on the same tensors, with identical results (measured for
1-300 rows at the SmolLM2 shapes). On CPUs with AMX, decode-sized batches of bias-free bf16
projections take the kernel library's AMX matmul (`kernels.linear_packed`) instead, which streams
the weights faster than oneDNN at those sizes; larger batches keep oneDNN, faster there. Everything
else takes the plain `F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
from kernels import tuning

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

    Holds the weight only in the forms its calls use: the AMX tiles and oneDNN's packing where they
    apply, and then not the plain tensor as well (it would be a third copy of every projection)."""

    __slots__ = ("bias", "_weight", "_tiles", "_packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self._tiles = kernels.pack_linear_weight(weight) if bias is None else None
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_BATCH_HINT) if _can_prepack(weight) else None
        self._weight = weight if self._packed is None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._tiles is not None and x.shape[0] <= tuning.AMX_LINEAR_MAX_ROWS:
            return kernels.linear_packed(x, self._tiles)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self._weight, self.bias)
