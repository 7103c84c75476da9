"""Rotary position embeddings (the rotate-half layout of the Llama family)."""
from __future__ import annotations

import torch


class RotaryEmbedding:
    """Precomputed cos/sin tables `[max_positions, head_dim]` in the model's dtype on its device,
    indexed by each token's position (`kernels.rotary_store_kv` applies them)."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, attention_scaling: float, dtype: torch.dtype,
                 device: str) -> None:
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.to(torch.float32))  # [max_positions, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = (angles.cos() * attention_scaling).to(device, dtype)
        self.sin = (angles.sin() * attention_scaling).to(device, dtype)
