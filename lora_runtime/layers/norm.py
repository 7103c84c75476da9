"""RMS normalisation, computed in float32 as the reference implementations do."""
from __future__ import annotations

import torch


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * hidden / sqrt(mean(hidden**2) + eps)`; hidden `[num_tokens, hidden_size]`."""
    input_dtype = hidden.dtype
    hidden32 = hidden.to(torch.float32)
    variance = hidden32.pow(2).mean(-1, keepdim=True)
    normalised = hidden32 * torch.rsqrt(variance + eps)
    return weight * normalised.to(input_dtype)
