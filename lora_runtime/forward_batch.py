"""The tensors of one step, passed explicitly from the model runner to the model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch



class LoraBatch(Protocol):
    """Adds each token's adapter delta to a projection's output (`adapters.page_tensors.LoraStep`)."""

    def apply(self, layer_idx: int, projection: str, y: torch.Tensor, x: torch.Tensor) -> None:
        """y `[num_tokens, out]` += LoRA(x `[num_tokens, in]`) for projection qkv | o | gate_up | down."""


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """A flat batch of tokens from many requests (prefill chunks and decode tokens mixed)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat KV slot of each token
    attention: object  # the step's attention plan, built by the model's backend (`Backend.plan_attention`)
    logits_indices: torch.Tensor  # [num_logit_rows] int64, tokens whose next-token logits are needed
    request_lens: torch.Tensor  # [num_tokens] int64, each token's request's length so far (LongRoPE's choice)
    lora: LoraBatch | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
