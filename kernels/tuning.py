"""Every measured threshold and tile choice of the kernel library, in one place, with the reason.

C++ constants included: `CPU_KERNEL_CONSTANTS` is compiled into the CPU ops (setup.py writes it into
a generated header, `lora_serve_tuning.h`), so changing one here and running `make install` rebuilds
them; the built library reports the values it was compiled with (`kernels.cpu_ops.ops().constants()`,
checked by tests/kernels/test_cpu_ops_build.py). Re-measure a choice with the benchmark its comment
names (`python -m benchmarks.kernels`, one thread) on the CPU at hand; results go to benchmarks/results/.
This module imports nothing, so the build can read it without PyTorch."""
from __future__ import annotations

# Compile-time constants of kernels/csrc/ (snake_case here, kCamelCase in C++).
CPU_KERNEL_CONSTANTS: dict[str, int] = {
    # Rows per task of the thread pool for the per-row ops (norms, SiLU, rotary): enough work per
    # task to amortise the pool's dispatch, few enough that 64 decode rows still split over threads.
    "rows_per_task": 16,
    # Matmul register tiles (kernels/csrc/gemm_tiles.h), of the projections and of the LoRA op's shrink
    # and expand: rows x blocks of 16 columns of float32 accumulators; the kernels instantiate 1-16
    # rows and 1-3 blocks. A block is one zmm (AVX-512) or
    # two ymm (AVX2) per row. AVX512-BF16 and AVX-512 fp32: 8 x 3 = 24 of the 32 zmm registers;
    # measured on AMD Zen 5 (bf16), 6x64 and 4x96 spilled registers and ran much slower, 12x32
    # slightly slower (`python -m benchmarks.kernels --quick --dtype bfloat16`). AVX2: 6 x 1 block =
    # 12 of the 16 ymm registers, the shape of the classic AVX2 sgemm microkernel.
    "bf16_linear_tile_rows": 8,
    "bf16_linear_tile_blocks": 3,
    "f32_linear_tile_rows_avx512": 8,
    "f32_linear_tile_blocks_avx512": 3,
    "f32_linear_tile_rows_avx2": 6,
    "f32_linear_tile_blocks_avx2": 1,
    # bf16 widened to float32 (the AVX-512 and AVX2 forms): the same accumulators as float32. Intel
    # Xeon (family 6 model 207), GFLOP/s at 16 / 64 rows over the projections' shapes, weights out of
    # cache: AVX-512 8x3 130-137, 6x3 120-131, 8x2 92-132; AVX2 6x1 58-63, 5x1 55 / 65, 4x1 56-57.
    "bf16_fma_tile_rows_avx512": 8,
    "bf16_fma_tile_blocks_avx512": 3,
    # The AVX-512 form's widened bf16 matmul on batches of at least this many rows (its tile above
    # for fewer, and for the LoRA op): 16 rows x 1 block, x widened and packed k-major once a call, so
    # each multiplier is a broadcast operand of its `vfmadd` and a block's two widening operations
    # serve 32 of them (8 x 3: 6 for 48). Xeon (family 6 model 207), GFLOP/s, weights cycled, against
    # 8 x 3: 576 -> 3072 / 960 / 576 at 16-128 rows 146-157 against 133-143; 12 x 2 between the two.
    # 1536 -> 576 (the down projection) ran slower on it (129-138 against 136-145) until the row
    # blocks and the vector packing of x: now 155-167 against 136-157 at 16-1280 rows (three rounds,
    # alternated), and in the engine's base workload the down projection's decode matmuls 139-144 ->
    # 161-163 GFLOP/s. The bound on K is the largest measured (a block of 16 columns x 2048 inputs is
    # 64 KB of weights, beyond L1); longer inputs keep the 8 x 3 tile, unmeasured with this one.
    "bf16_fma_tall_tile_rows_avx512": 16,
    "bf16_fma_tall_tile_blocks_avx512": 1,
    "bf16_fma_tall_tile_max_k_avx512": 2048,
    "bf16_fma_tile_rows_avx2": 6,
    "bf16_fma_tile_blocks_avx2": 1,
    # The matmuls' row blocks (kernels/csrc/linear.cpp): every column group of a call runs over one
    # block of rows, whose x (as the tiles read it) takes at most this many bytes, before the next
    # block starts, so that x is read from L2 rather than L3 (a prefill's x outgrows L2). A quarter of
    # Zen 5's L2, half of Zen 3's. Xeon (family 6 model 207, 2 MB L2), bf16 widened, 1280 rows, GFLOP/s
    # against one block of all rows: 576 -> 3072 144-150 against 129, 576 -> 960 147 against 137,
    # 1536 -> 576 138 against 132 (128 KiB and 512 KiB within noise of 256); in the engine (base
    # workload, alternated with the build before, three rounds) prefill matmuls 129-135 -> 141-149.
    "linear_row_block_bytes": 256 * 1024,
    # The portable tiles (plain loops; the LoRA op's tiles in forms without the instructions).
    "portable_tile_rows": 4,
    "portable_tile_blocks": 1,
    # LoRA op (kernels/csrc/lora.cpp): rows of a segment whose expand reads each column group's runs
    # of B once (the chunk's shrunk rows are float32 scratch: rows x 16 per page of the projection).
    # AMD Zen 5, bf16, W's prefill (8 adapters of 320 tokens, ranks 8-64, pages in cache; `python -m
    # benchmarks.lora_memory`, "W prefill"): 4.6-4.9 ms a layer against 5.1 ms for 8 rows (one row
    # tile at a time); 16 and 64 rows measured as 32 within noise; decode batches are unchanged.
    "lora_chunk_rows": 32,
    # LoRA op: how far ahead of its tiles the op requests its pages (a decode step reads them from
    # memory: they outgrow the caches between steps), in the AVX-512 forms and in the others. AMD Zen
    # 5, one thread, W alternated in one process against each segment requesting the next one's
    # pages (the scheme before): AVX512-BF16 bf16, 64 KiB one point lower LoRA overhead (11 of 12
    # rounds); AVX-512 float32, 64 KiB +14.7% and 32 KiB +15.0% against +17.8% (3 of 3); AVX2
    # float32, 32 KiB +13.0% against +13.1%, 64 KiB +13.2% against +11.4%. The 1024-adapter sweep
    # (bf16) unchanged (60.8% / 60.9%). The op alone on 118 one-token segments, pages flushed: 5-9%
    # faster at 64-128 KiB, no better at 256, slower at 1024 (L2 is 1 MiB).
    "lora_fetch_lead_bytes_avx512": 64 * 1024,
    "lora_fetch_lead_bytes": 32 * 1024,
    # max/logsumexp: the first index of a row's maximum is found by a vectorised test per chunk of
    # this many logits, then a scalar scan within the chunk.
    "first_index_chunk": 64,
    # A matmul fetches the pages the next op reads (LinearArgs::fetch_runs) only when it does at
    # least this many FLOPs per fetched byte: a shorter matmul cannot hide the reads, and a decode
    # step of one long sequence (1 row, 1.7-5 MB of KV cache a layer) then waits for them instead.
    # AMD Zen 5, bf16 (~500 GFLOP/s, ~40 GB/s: 12.5 FLOPs per byte at both limits): workload W's
    # qkv (71 MFLOP; then 4.9 MB fetched, its KV blocks with the adapter pages the matmuls fetched
    # at the time, which the LoRA op now fetches itself) gained; one sequence decoding after 6000
    # prompt tokens took 22.7 ms a token with its KV fetched against 19.0 without.
    "fetch_min_flops_per_byte": 10,
    # Instruction-peak probes (kernels/csrc/peak.cpp): independent multiply-add chains, enough to
    # hide the instruction's latency (on AMD Zen 5 the AVX512-BF16 rate stops growing at 16), within
    # the registers: 24 of 32 zmm, 12 of 16 ymm (the other registers hold the operands).
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

# CPU bf16 projections on AMX machines: batches of at most this many rows take the compiled AMX
# matmul (kernels/csrc/amx_linear.cpp), larger ones oneDNN's prepacked matmul. Per call, the weight
# cycled over 8 copies (out of cache, as in a decode step), oneDNN time / AMX time on an Intel Xeon
# (`python -m benchmarks.kernels --quick --dtype bfloat16`): 576 -> 3072: 64 rows 1.15x, 96 1.07x,
# 128 0.96x, 256 0.87x; 1536 -> 576: 1.18x, 1.13x, 1.05x, 1.01x; the LM head 576 -> 49152: 1.02x,
# 0.92x, 0.86x, 0.96x.
AMX_LINEAR_MAX_ROWS = 96
# CPU bf16 projections without AMX (kernels/csrc/linear.cpp: `vdpbf16ps` on AVX512-BF16, widened
# to float32 on AVX-512 and AVX2) take the compiled matmul at every batch size, and no oneDNN copy
# of the weight is kept. oneDNN time / ours
# on AMD Zen 5, rows 1 / 16 / 64 / 128 / 256: 576 -> 3072: 1.11x, 1.69x, 1.19x, 1.13x, 1.04x;
# 1536 -> 576: 1.35x, 1.53x, 1.18x, 1.11x, 1.05x; the LM head 576 -> 49152: 0.93x, 1.64x, 1.20x,
# 1.11x, 1.05x; at 512 and 2048 rows 1.01-1.07x.

# The AVX512-BF16 form is used only where `vdpbf16ps` does at least this share of the FLOPs per
# second of float32 FMA (kernels/csrc/peak.cpp's probes, best of FORM_PROBE_TRIES runs of
# FORM_PROBE_ITERATIONS each, 20 ms at import here); elsewhere the AVX-512 form, whose bf16 matmul
# widens the weights to float32 and multiplies them with `vfmadd` (two FMAs per pair of k where
# `vdpbf16ps` takes one, plus the widening: it wins below ~0.9). Intel Xeon (family 6 model 207,
# AMX hidden by the hypervisor): `vdpbf16ps` 86 GFLOP/s against FMA 175 (0.49); the widened matmul
# ran 576 -> 3072 at 135 GFLOP/s against 84 for 16-64 rows, and the engine's bf16 base workload at
# 273.8 against 186.1 tokens/CPU-s. AMD Zen 5: 568 against 271 (2.1): the AVX512-BF16 form.
BF16_DOT_MIN_SHARE_OF_FMA = 1.0
FORM_PROBE_ITERATIONS = 300_000
FORM_PROBE_TRIES = 3

# Row count oneDNN's packed bf16 weight layout is tuned for: a typical decode step of the default scheduler.
ONEDNN_PACKING_ROWS = 64

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
