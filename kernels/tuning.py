"""Every measured threshold and tile choice of the kernel library, in one place, with the reason.

Figures are from `python -m benchmarks.kernels` on the development CPU (1 thread); see the report
in benchmarks/results/ for the numbers behind each choice."""
from __future__ import annotations

# CPU add_lora: the per-segment loop costs ~2 small matmul calls per segment and slice; the
# gathered form costs a weight gather per token. The gather only wins when almost every token is
# its own segment and there are many of them.
GATHERED_LORA_MIN_SEGMENTS = 32
GATHERED_LORA_MAX_TOKENS_PER_SEGMENT = 1.5


def use_gathered_lora(num_active_tokens: int, num_segments: int) -> bool:
    """Whether the CPU add_lora should take the per-token gathered form over the segment loop."""
    return (
        num_segments >= GATHERED_LORA_MIN_SEGMENTS
        and num_active_tokens <= GATHERED_LORA_MAX_TOKENS_PER_SEGMENT * num_segments
    )
