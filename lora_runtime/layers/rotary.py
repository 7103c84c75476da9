"""Rotary position embeddings (the rotate-half layout of the Llama family)."""
from __future__ import annotations

import torch


class RotaryEmbedding:
    """Precomputed cos/sin tables `[max_positions, head_dim]`, indexed by each token's position."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, attention_scaling: float, dtype: torch.dtype) -> None:
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.to(torch.float32))  # [max_positions, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = (angles.cos() * attention_scaling).to(dtype)
        self.sin = (angles.sin() * attention_scaling).to(dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the step's tokens, shaped `[num_tokens, 1, head_dim]` to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[num_tokens, num_heads, head_dim]` rotated by the tables of `RotaryEmbedding.tables`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
