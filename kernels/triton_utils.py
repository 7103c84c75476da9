"""Small helpers shared by the Triton wrappers."""
from __future__ import annotations

import os

import torch
import triton


def is_interpreter() -> bool:
    """Whether Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def upcast_dot_inputs() -> bool:
    """The interpreter computes tl.dot on bf16 tiles wrongly (Triton issue 11584): cast the tiles to
    fp32 there. On GPU the tiles stay in their dtype so tl.dot uses tensor cores."""
    return is_interpreter()


def next_power_of_2(value: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(value))


def shrink_buffer(num_tokens: int, width: int, split_k: int, device: torch.device) -> torch.Tensor:
    """A LoRA shrink's float32 output [num_tokens, width]: zeros when split-K programs add into it,
    else left uninitialised (the expand reads only the elements the shrink writes)."""
    if split_k > 1:
        return torch.zeros(num_tokens, width, dtype=torch.float32, device=device)
    return torch.empty(num_tokens, width, dtype=torch.float32, device=device)


def k_per_split(hidden_in: int, split_k: int, block_k: int) -> int:
    """Reduction columns per split-K program: a whole number of block_k tiles."""
    return triton.cdiv(triton.cdiv(hidden_in, split_k), block_k) * block_k
