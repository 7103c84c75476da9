"""Every measured threshold and tile choice of the kernel library, in one place, with the reason.

C++ constants included: `CPU_KERNEL_CONSTANTS` is compiled into the CPU ops (setup.py writes it into
a generated header, `lora_serve_tuning.h`), so changing one here and running `make install` rebuilds
them; the built library reports the values it was compiled with (`kernels.cpu_ops.ops().constants()`,
checked by tests/kernels/test_cpu_ops_build.py). Re-measure a choice with the benchmark its comment
names (`python -m benchmarks.kernels`, one thread) on the CPU at hand; results go to benchmarks/results/,
and the measurements behind today's values are in docs/benchmarks.md.
This module imports nothing, so the build can read it without PyTorch."""
from __future__ import annotations

# Compile-time constants of kernels/csrc/ (snake_case here, kCamelCase in C++).
CPU_KERNEL_CONSTANTS: dict[str, int] = {
    # The thread pool's tasks (kernels/csrc/bindings.cpp; PyTorch's pool, `torch.set_num_threads`).
    # Per-row ops (norms, SiLU, rotary): at least this many elements a task (16 rows of the embedded
    # model's hidden size), enough to outweigh handing a task to a thread (an OpenMP region costs a
    # few microseconds), few enough that a decode batch of 64 rows splits over 4-8 threads.
    "row_task_min_elements": 8192,
    # Matmuls: column groups alone while they give every thread this many (the threads' ranges then
    # differ by at most a quarter); else the rows are split too, into parts of at least this many rows
    # (each part reads all its columns' weights again, which decode batches cannot afford).
    "linear_min_groups_per_thread": 4,
    "linear_min_rows_per_part": 32,
    # LoRA op: tasks of about 1 / lora_tasks_per_thread of a thread's share of the call's FLOPs
    # (segments cut into pieces of whole tiles of rows, then into column parts where a piece is still
    # too heavy: a rank-64 adapter's few decode tokens; a part shrinks only the slices it touches),
    # none below lora_min_task_flops (a few microseconds), column parts of at least
    # lora_min_columns_per_part of the slices' columns together.
    "lora_tasks_per_thread": 4,
    "lora_min_task_flops": 256 * 1024,
    "lora_min_rows_per_task": 8,
    "lora_min_columns_per_part": 64,
    # LoRA op: a piece of a segment is cut into column parts only while it outweighs this share (in
    # percent) of a thread's share of the call. Each part redoes the shrink of the slices it touches,
    # so a cut costs work every thread pays for; below half a share the cost-balanced ranges even the
    # tasks out without it. Chosen on workload W's decode step (8 adapters of ranks 8-64, all-linear,
    # 8 tokens each): with the parts' extra work counted, half a share gave the best or equal busiest
    # thread at 2, 4 and 16 threads (a quarter of a share kept cutting q/k/v at 2 threads).
    "lora_column_split_share_percent": 50,
    # Paged attention (kernels/csrc/task_plans.h): one task per (sequence, KV head), handed to the
    # threads in ranges of about equal keys read; on 2+ threads a decode token whose keys outweigh
    # 1 / attention_tasks_per_thread of a thread's share is split into chunks of its keys (partial
    # maximum and sum per chunk, merged after: "split-K"), so that one long decode keeps every thread
    # busy, none shorter than attention_min_keys_per_task keys (a chunk costs a slot of partial results
    # and a merge; 256 keys of 3 heads of 64 are ~200k FLOPs, tens of microseconds against an OpenMP
    # hand-over of a few). A task's fixed cost (its setup, its first block's miss) counts as
    # attention_task_overhead_keys keys when the ranges are balanced. A batch of many short decodes
    # is never split (every pair is under a thread's share); re-measure with
    # `python -m benchmarks.threads --threads 1,2` and a long single decode.
    "attention_tasks_per_thread": 4,
    "attention_min_keys_per_task": 256,
    "attention_task_overhead_keys": 16,
    # Matmul register tiles (kernels/csrc/gemm_tiles.h), of the projections and of the LoRA op's shrink
    # and expand: rows x blocks of 16 columns of float32 accumulators; the kernels instantiate 1-16
    # rows and 1-3 blocks. A block is one zmm (AVX-512) or two ymm (AVX2) per row. The tile is the
    # largest that leaves registers for the operands: AVX512-BF16 and AVX-512 fp32 8 x 3 = 24 of the
    # 32 zmm (larger tiles spilled and ran much slower); AVX2 6 x 1 block = 12 of the 16 ymm, the
    # shape of the classic AVX2 sgemm microkernel. Measured with `python -m benchmarks.kernels --quick
    # --dtype bfloat16` (docs/benchmarks.md, "Why the tuning constants are what they are").
    "bf16_linear_tile_rows": 8,
    "bf16_linear_tile_blocks": 3,
    "f32_linear_tile_rows_avx512": 8,
    "f32_linear_tile_blocks_avx512": 3,
    "f32_linear_tile_rows_avx2": 6,
    "f32_linear_tile_blocks_avx2": 1,
    # bf16 widened to float32 (the AVX-512 and AVX2 forms): the same accumulators as float32, and the
    # same choice of tile (figures in docs/benchmarks.md).
    "bf16_fma_tile_rows_avx512": 8,
    "bf16_fma_tile_blocks_avx512": 3,
    # The AVX-512 form's widened bf16 matmul on batches of at least this many rows (its tile above
    # for fewer, and for the LoRA op): 16 rows x 1 block, x widened and packed k-major once a call, so
    # each multiplier is a broadcast operand of its `vfmadd` and a block's two widening operations
    # serve 32 of them (8 x 3: 6 for 48). It trades L1 residency of the weights for fewer widening
    # operations: a block of 16 columns x K inputs must stay in L1 over the row tiles, so K is bounded
    # by the largest measured (2048: 64 KB of weights); longer inputs keep the 8 x 3 tile. Figures in
    # docs/benchmarks.md.
    "bf16_fma_tall_tile_rows_avx512": 16,
    "bf16_fma_tall_tile_blocks_avx512": 1,
    "bf16_fma_tall_tile_max_k_avx512": 2048,
    "bf16_fma_tile_rows_avx2": 6,
    "bf16_fma_tile_blocks_avx2": 1,
    # The matmuls' row blocks (kernels/csrc/linear.cpp): every column group of a call runs over one
    # block of rows, whose x (as the tiles read it) takes at most this many bytes, before the next
    # block starts, so that x is read from L2 rather than L3 (a prefill's x outgrows L2). Sized for a
    # 1-2 MB L2 with room for the weights' column group; measured on a 2 MB L2 (128 and 512 KiB were
    # within noise; docs/benchmarks.md). Re-measure with prefill-sized batches on a CPU whose L2 differs.
    "linear_row_block_bytes": 256 * 1024,
    # The AMX matmul's chunks of rows (kernels/csrc/amx_linear.cpp): every column block runs over one
    # chunk, whose x takes at most this many bytes, before the next chunk starts. Larger than the
    # register tiles' blocks: each chunk reads the weights again (from memory, past a few layers),
    # and the tiles consume them ~3x faster. Sized for a 2 MB L2, a column block's weights (K x 32)
    # beside the chunk.
    "amx_linear_row_block_bytes": 1024 * 1024,
    # The portable tiles (plain loops; the LoRA op's tiles in forms without the instructions).
    "portable_tile_rows": 4,
    "portable_tile_blocks": 1,
    # LoRA op (kernels/csrc/lora.cpp): rows of a segment whose expand reads each column group's runs
    # of B once (the chunk's shrunk rows are float32 scratch: rows x 16 per page of the projection).
    # More rows read B fewer times but need more scratch; decode batches (a few rows a segment) are
    # unaffected. Measured with `python -m benchmarks.lora_memory`, "W prefill" (docs/benchmarks.md).
    "lora_chunk_rows": 32,
    # LoRA op: how far ahead of its tiles the op requests its pages (a decode step reads them from
    # memory: they outgrow the caches between steps), in the AVX-512 forms and in the others. Too
    # short a lead leaves reads exposed; too long evicts pages from L2 before they are used (the op
    # slowed at 1 MiB on a 1 MiB L2). Measured by alternating workload W's runs in one process
    # (`python -m benchmarks.engine --adapters 8 --targets all-linear`; docs/benchmarks.md).
    "lora_fetch_lead_bytes_avx512": 64 * 1024,
    "lora_fetch_lead_bytes": 32 * 1024,
    # max/logsumexp: the first index of a row's maximum is found by a vectorised test per chunk of
    # this many logits, then a scalar scan within the chunk.
    "first_index_chunk": 64,
    # A matmul fetches the pages the next op reads (LinearArgs::fetch_runs) only when it does at
    # least this many FLOPs per fetched byte: a shorter matmul cannot hide the reads, and a decode
    # step of one long sequence (1 row, 1.7-5 MB of KV cache a layer) then waits for them instead.
    # Set just under a CPU's peak FLOPs over its read bandwidth (12.5 where measured;
    # docs/benchmarks.md).
    "fetch_min_flops_per_byte": 10,
    # Instruction-peak probes (kernels/csrc/peak.cpp): independent multiply-add chains, enough to
    # hide the instruction's latency (the measured AVX512-BF16 rate stops growing at 16), within the
    # registers: 24 of 32 zmm, 12 of 16 ymm (the other registers hold the operands).
    "peak_chains_avx512": 24,
    "peak_chains_avx2": 12,
}

# Prefills the compiled attention op takes: q_len * context_len at most this, per form. Its work
# grows as q_len * context in vector loops, the matmul path's as library matmuls plus ~0.3 ms of
# fixed Python cost. One bf16 prompt, 9/3 heads, per layer, compiled vs matmul:
# - AVX-512 register-blocked form (head_dim 64): 256 tokens 3.0 vs 3.9 ms, 512: 11.0 vs 11.4, 1024: 41 vs 33;
# - portable loops: 32 tokens 0.12 vs 0.36 ms, 64: 0.33 vs 0.53, 96: 0.74 vs 0.78, 128: 1.24 vs 1.11.
# (Head sizes other than 64 and 128 take the portable loops in every form.)
COMPILED_PREFILL_MAX_WORK_VECTOR = 256 * 256
COMPILED_PREFILL_MAX_WORK = 10_000


def compiled_prefill_max_work(has_vector_attention: bool) -> int:
    return COMPILED_PREFILL_MAX_WORK_VECTOR if has_vector_attention else COMPILED_PREFILL_MAX_WORK


# CPU paged attention without the compiled ops: decode sequences per padded gather + attention call.
# 64 sequences of 20-150 tokens (head_dim 64, 9/3 heads): one bucket of 64 took 9-24 ms fp32 (1.9x
# padding, buffers so big that allocating them dominates), buckets of 8-16 took ~4 ms, one call per
# sequence ~9 ms.
DECODE_BUCKET_SEQS = 12

# CPU paged attention, prefill by matmuls: queries per scores chunk. Bounds the [heads, chunk, keys]
# scores (256 x 4096 keys x 9 heads fp32 = 38 MB) while keeping each matmul large.
PREFILL_QUERY_CHUNK = 256

# CPU bf16 projections take their form's compiled matmul at every batch size, and no oneDNN copy of
# the weight is kept (one copy of each projection in memory). Without AMX (kernels/csrc/linear.cpp:
# `vdpbf16ps` on AVX512-BF16, widened to float32 on AVX-512 and AVX2) it was faster than oneDNN's
# prepacked matmul at every measured batch but the LM head's single row. On AMX
# (kernels/csrc/amx_linear.cpp, x in chunks of `amx_linear_row_block_bytes`) it is about even with
# oneDNN at prefill-sized batches, a little slower on the widest reduction (figures in docs/benchmarks.md).

# The AVX512-BF16 form is used only where `vdpbf16ps` does at least this share of the FLOPs per
# second of float32 FMA (kernels/csrc/peak.cpp's probes, best of FORM_PROBE_TRIES runs of
# FORM_PROBE_ITERATIONS each, 20 ms at import); elsewhere the AVX-512 form, whose bf16 matmul
# widens the weights to float32 and multiplies them with `vfmadd`. Widening takes two FMAs per pair
# of k where `vdpbf16ps` takes one, plus the widening itself, so it wins below a share of about 0.9;
# the CPUs measured sit far on either side (0.49 and 2.1; docs/benchmarks.md).
BF16_DOT_MIN_SHARE_OF_FMA = 1.0
FORM_PROBE_ITERATIONS = 300_000
FORM_PROBE_TRIES = 3


# Triton LoRA tiles (kernels/lora/sgmv.py, bgmv.py). tl.dot needs every tile dimension >= 16 on GPU.
# A shrink program covers one page of the adapter (16 rank rows, kernels/lora/layouts.PAGE_ROWS).
SGMV_BLOCK_M = 16  # tokens of one segment per program
LORA_BLOCK_N = 32  # output columns per expand program
LORA_BLOCK_K = 64  # reduction columns per step of the shrink (hidden_in)
# Split-K for the shrink: a program's output is one page, 16 rank rows, so with a wide input few
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


# Triton matmul over quantized blocks (kernels/quantized_matmul.py): x rows and output columns per
# program, and reduction columns per step (a multiple of 32, the finest scale granularity of every type).
QUANTIZED_BLOCK_M = 16
QUANTIZED_BLOCK_N = 32
QUANTIZED_BLOCK_K = 64


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

# Quantized weights (kernels.linear.QuantizedLinear): batches of up to this many rows multiply by int8
# dot products over the blocks (cost growing with the rows); larger ones widen the weights to bf16 inside
# the tiles (cost nearly flat in the rows: the widening). Re-measure with
# `python -m benchmarks.quantized --kernels` (one thread) on the CPU at hand: on the Xeon family 6
# model 207 the widened path overtook the int8 one between 8 and 16 rows (Q8_0 and Q4_K).
QUANTIZED_INT8_MAX_ROWS = 8
# Where the CPU has AMX-INT8 (the AMX form; kernels/csrc/quantized_amx.cpp), batches within these row
# ranges multiply on its int8 tiles instead of either path above, whatever QUANTIZED_INT8_MAX_ROWS says.
# Measured with `python -m benchmarks.quantized --kernels` (one thread, 8192 x 2048, weights cycled from
# memory, the least of 12 calls, a busy machine; 128 rows from a second run) on the Xeon family 6
# model 207; ms per call:
#   rows               1     4     8     16    32    64   (128)
#   bf16 matmul        2.80  2.88  2.80  2.80  2.88  3.51  4.88
#   Q8_0 AMX-INT8      1.72  1.85  1.89  2.05  3.17  5.50  10.22
#   Q8_0 int8 / wide   2.55  3.47  4.91  5.78  6.10  7.53  11.72  (int8 dots to 8 rows, widened above)
#   Q4_K AMX-INT8      3.95  3.74  3.74  3.82  4.63  7.59  13.47
#   Q4_K int8 / wide   2.48  3.57  5.34  5.87  6.49  7.65  10.77  (int8 dots to 8 rows, widened above)
# Q8_0's tiles load straight from its blocks and win from one row to 128 (the last measured); every
# other type is unpacked first (a pass through L2 that costs about as much as a call at one row), which
# the int8 dot products beat below 8 rows; the widened tiles, 1.4x slower at 32 rows, are even at 64:
# the range ends between the two.
QUANTIZED_AMX_ROWS_Q8_0 = (1, 128)
QUANTIZED_AMX_ROWS_UNPACKED = (8, 48)


def quantized_amx_rows(type_name: str) -> tuple[int, int]:
    """The fewest and most rows the AMX-INT8 matmul takes for blocks of `type_name`."""
    return QUANTIZED_AMX_ROWS_Q8_0 if type_name == "Q8_0" else QUANTIZED_AMX_ROWS_UNPACKED
