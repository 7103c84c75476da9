"""Every measured threshold and tile choice of the kernel library, in one place, with the reason.

Figures are from `python -m benchmarks.kernels` on the development CPU (1 thread); see the report
in benchmarks/results/ for the numbers behind each choice."""
from __future__ import annotations

import torch

# CPU add_lora with fp32 weights in the pool's layout (lora_b's output dimension contiguous) takes
# the compiled op (kernels/csrc/lora.cpp): 64 tokens over 8 adapters, 576 -> 1536, fp32, it adds
# 6-13% to the base projection at ranks 8-16 against 10-20% for the segment loop below. The
# thresholds below choose among the PyTorch paths, which serve every other case.
# CPU add_lora: the per-segment loop costs ~2 small fp32 matmul calls per segment and slice; the
# gathered form copies each token's B (the [total_out, rank] weight) and runs batched matmuls.
# Measured (64 tokens, 576 -> 1536, rank 16): with fp32 weights the loop always won (64 distinct
# adapters: 2.8 vs 3.5 ms); with bf16 weights the gathered bf16 form won from ~16 segments of
# <= 4 tokens (64 distinct: 1.8 vs 14.7 ms native bf16 loop or ~3 ms loop with fp32 casts).
GATHERED_LORA_MIN_SEGMENTS = 16
# CPU add_lora with 16-bit inputs: a segment of at least this many tokens runs in its own dtype,
# shorter ones in fp32. One segment, rank 16, 576 -> 1536, bf16 in place vs cast to fp32 and back:
# 4 tokens 122 vs 69 us, 32 tokens 154 vs 148 us, 64 tokens 220 vs 275 us, 256 tokens 444 vs 2596 us.
NATIVE_16BIT_MIN_SEGMENT_TOKENS = 32
GATHERED_LORA_MAX_TOKENS_PER_SEGMENT = 4.0


def use_gathered_lora(weight_dtype: torch.dtype, num_active_tokens: int, num_segments: int) -> bool:
    """Whether the CPU add_lora should take the per-token gathered form over the segment loop."""
    return (
        weight_dtype in (torch.bfloat16, torch.float16)
        and num_segments >= GATHERED_LORA_MIN_SEGMENTS
        and num_active_tokens <= GATHERED_LORA_MAX_TOKENS_PER_SEGMENT * num_segments
    )


# The compiled CPU ops (kernels/cpu_ops.py, kernels/csrc/): attention read in place from the paged
# cache, the fused norms, SiLU-and-multiply, rotary + KV write. The PyTorch paths serve where they
# cannot be built; tests switch them off to cover those paths.
CPU_COMPILED_OPS = True
# Prefills the compiled attention op takes: q_len * context_len at most this. Its work grows as
# q_len * context in vector loops, the matmul path's as AMX matmuls plus ~0.3 ms of fixed Python
# cost. One bf16 prompt, 9/3 heads, per layer, compiled vs matmul:
# - AVX-512 form (head_dim 64): 256 tokens 3.0 vs 3.9 ms, 512: 11.0 vs 11.4, 1024: 41 vs 33;
# - portable loops: 32 tokens 0.12 vs 0.36 ms, 64: 0.33 vs 0.53, 96: 0.74 vs 0.78, 128: 1.24 vs 1.11.
# (Head sizes other than 64 and 128 take the portable loops even on AVX-512 machines: slower there
# for prompts of 100-256 tokens, still correct.)
COMPILED_PREFILL_MAX_WORK_AVX512 = 256 * 256
COMPILED_PREFILL_MAX_WORK = 10_000


def compiled_prefill_max_work(has_avx512: bool) -> int:
    return COMPILED_PREFILL_MAX_WORK_AVX512 if has_avx512 else COMPILED_PREFILL_MAX_WORK

# CPU paged attention: decode sequences per padded gather + attention call. 64 sequences of 20-150
# tokens (head_dim 64, 9/3 heads): one bucket of 64 took 9-24 ms fp32 (1.9x padding, buffers so big
# that allocating them dominates), buckets of 8-16 took ~4 ms, one call per sequence ~9 ms.
DECODE_BUCKET_SEQS = 12

# CPU paged attention, prefill: queries per scores chunk. Bounds the [heads, chunk, keys] scores
# (256 x 4096 keys x 9 heads fp32 = 38 MB) while keeping each matmul large.
PREFILL_QUERY_CHUNK = 256

# Triton LoRA tiles. tl.dot needs every tile dimension >= 16 on GPU.
SGMV_BLOCK_M = 16  # tokens of one segment per program
LORA_BLOCK_N = 32  # output columns per program (rank columns for shrink, hidden for expand)
LORA_BLOCK_K = 64  # reduction columns per step of the shrink (hidden_in)
# Split-K for the shrink: its output is only num_slices * rank wide, so with a wide input few
# programs run; split the reduction into chunks of at least this many input columns.
SPLIT_K_MIN_COLS = 1024
MAX_SPLIT_K = 8
# add_lora on Triton takes BGMV (one program per token) when segments average fewer tokens than
# this: an SGMV tile of SGMV_BLOCK_M rows would be mostly padding.
BGMV_MAX_TOKENS_PER_SEGMENT = 4.0


def split_k_for(hidden_in: int) -> int:
    """How many programs share the reduction of one shrink tile."""
    return max(1, min(MAX_SPLIT_K, hidden_in // SPLIT_K_MIN_COLS))


def use_bgmv(num_active_tokens: int, num_segments: int) -> bool:
    return num_active_tokens < BGMV_MAX_TOKENS_PER_SEGMENT * num_segments

# Triton paged attention. Decode splits a context across programs only when the batch alone does
# not fill the GPU: aim for about DECODE_TARGET_PROGRAMS programs, each split covering at least
# DECODE_MIN_SPLIT_TOKENS keys; the number of splits is a power of two (the merge uses tl.arange).
DECODE_TARGET_PROGRAMS = 512
DECODE_MIN_SPLIT_TOKENS = 256
DECODE_MAX_SPLITS = 16
PREFILL_BLOCK_M = 16  # new tokens per prefill program


def decode_splits(num_programs: int, max_seq_len: int) -> int:
    """Splits per (sequence, KV head) for the Triton decode kernel."""
    wanted = max(1, DECODE_TARGET_PROGRAMS // max(1, num_programs))
    affordable = max(1, max_seq_len // DECODE_MIN_SPLIT_TOKENS)
    splits = min(wanted, affordable, DECODE_MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)  # round down to a power of two

# CPU bf16 projections on AMX machines: batches of at most this many rows take the compiled AMX
# matmul (kernels/csrc/amx_linear.cpp), larger ones oneDNN's prepacked matmul. Per call, the weight
# cycled over 8 copies (out of cache, as in a decode step), oneDNN time / AMX time
# (`python -m benchmarks.kernels --quick --dtype bfloat16`): 576 -> 3072: 64 rows 1.15x, 96 1.07x,
# 128 0.96x, 256 0.87x; 1536 -> 576: 1.18x, 1.13x, 1.05x, 1.01x; the LM head 576 -> 49152: 1.02x,
# 0.92x, 0.86x, 0.96x.
AMX_LINEAR_MAX_ROWS = 96
# CPU bf16 projections on AVX512-BF16 CPUs without AMX (kernels/csrc/bf16_linear.cpp) take the
# compiled matmul at every batch size, and no oneDNN copy of the weight is kept. oneDNN time / ours
# on the development CPU (AMD Zen 5, one thread, each call on the next of 8 copies of the weight;
# `python -m benchmarks.kernels --quick --dtype bfloat16`), rows 1 / 16 / 64 / 128 / 256:
# 576 -> 3072: 1.11x, 1.69x, 1.19x, 1.13x, 1.04x; 1536 -> 576: 1.35x, 1.53x, 1.18x, 1.11x, 1.05x;
# the LM head 576 -> 49152: 0.93x, 1.64x, 1.20x, 1.11x, 1.05x. At 512 and 2048 rows (a one-off
# measurement of the same shapes, 8-30 copies) 1.01-1.07x.
