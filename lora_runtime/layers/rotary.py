"""Rotary position embeddings (the rotate-half layout of the Llama family), over the whole head or
its first `rotary_dim` dimensions (Phi-3/4's partial rotary)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LongFactors:
    """LongRoPE's second set of frequencies, taken by a token whose forward is longer than the
    pretraining length (`lora_runtime.models.rope` says how HF decides, and how we follow it)."""

    inv_freq: torch.Tensor  # [rotary_dim / 2]
    original_max_positions: int


class RotaryEmbedding:
    """Precomputed cos/sin tables `[num_sets * max_positions, rotary_dim]` in the model's dtype on its
    device: one set of frequencies, or LongRoPE's short set then its long set. A token reads the row
    `rows()` gives it (`kernels.rotary_store_kv` applies them to the first `rotary_dim` of each head)."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, attention_scaling: float, dtype: torch.dtype,
                 device: str, long_factors: LongFactors | None = None) -> None:
        self.max_positions = max_positions
        self.long_factors = long_factors
        sets = [inv_freq] if long_factors is None else [inv_freq, long_factors.inv_freq]
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.cat([torch.outer(positions, f.to(torch.float32)) for f in sets])  # [rows, rotary_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [rows, rotary_dim]
        self.cos = (angles.cos() * attention_scaling).to(device, dtype)
        self.sin = (angles.sin() * attention_scaling).to(device, dtype)

    def rows(self, positions: torch.Tensor, prompt_lens: torch.Tensor) -> torch.Tensor:
        """The table row of each token `[num_tokens]`: its position, moved to the long set where its
        forward, as HF runs a request alone, is longer than the pretraining length: the whole prompt
        for a prompt token, the sequence up to itself for a generated one."""
        if self.long_factors is None:
            return positions
        forward_lens = torch.maximum(positions + 1, prompt_lens)
        is_long = forward_lens > self.long_factors.original_max_positions
        return positions + is_long * self.max_positions
