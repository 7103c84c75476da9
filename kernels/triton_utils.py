"""Small helpers shared by the Triton wrappers."""
from __future__ import annotations

import os
from typing import Sequence

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


def slice_offsets_tensor(
    slice_offsets: torch.Tensor | Sequence[int] | None, y: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Column offsets of a fused projection as int32 on y's device ([num_slices + 1]; None = one
    slice over all of y), and the widest slice's width (for the grid), read on the host."""
    host = [0, y.shape[1]] if slice_offsets is None else [int(o) for o in slice_offsets]
    widest = max(end - begin for begin, end in zip(host[:-1], host[1:]))
    return torch.tensor(host, dtype=torch.int32, device=y.device), widest


def k_per_split(hidden_in: int, split_k: int, block_k: int) -> int:
    """Reduction columns per split-K program: a whole number of block_k tiles."""
    return triton.cdiv(triton.cdiv(hidden_in, split_k), block_k) * block_k
