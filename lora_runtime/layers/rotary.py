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
    """Precomputed cos/sin tables `[num_rows, rotary_dim]` in the model's dtype on its device: one set
    of frequencies over every position, or LongRoPE's short set over the positions before the
    pretraining length (the only ones it rotates) then its long set over every position. A token
    reads the row `rows()` gives it (`kernels.rotary_store_kv` applies them to the first `rotary_dim`
    of each head)."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, attention_scaling: float, dtype: torch.dtype,
                 device: str, long_factors: LongFactors | None = None) -> None:
        self.long_factors = long_factors
        self.num_short_rows = max_positions
        sets = [(inv_freq, max_positions)]
        if long_factors is not None:
            self.num_short_rows = min(max_positions, long_factors.original_max_positions)
            sets = [(inv_freq, self.num_short_rows), (long_factors.inv_freq, max_positions)]
        freqs = torch.cat([torch.outer(torch.arange(num_rows, dtype=torch.float32), f.to(torch.float32))
                           for f, num_rows in sets])  # [num_rows, rotary_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [num_rows, rotary_dim]
        self.cos = (angles.cos() * attention_scaling).to(device, dtype)
        self.sin = (angles.sin() * attention_scaling).to(device, dtype)

    def rows(self, positions: torch.Tensor, request_lens: torch.Tensor) -> torch.Tensor:
        """The table row of each token `[num_tokens]`: its position, moved to the long set where its
        request (`request_lens`: prompt and generated tokens so far) is longer than the pretraining
        length."""
        if self.long_factors is None:
            return positions
        is_long = request_lens > self.long_factors.original_max_positions
        return positions + is_long * self.num_short_rows
