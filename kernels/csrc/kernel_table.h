// The interface between the Python bindings (bindings.cpp, compiled once, with PyTorch's headers) and
// the kernels of one instruction-set form (compiled once per form, with that form's flags, into its
// own shared library; no PyTorch headers). The bindings check tensors, split the work over PyTorch's
// thread pool and call the active form's function on each range of tasks; a form's library exports
// one symbol, `lora_serve_kernel_table`, returning its table.
//
// Every kernel takes plain pointers, sizes and strides (elements, not bytes) and a task range
// [begin, end): rows, (sequence, KV head) pairs, segments or column groups, as each op documents.
// Semantics of every op: kernels/reference.py.
#pragma once
#include <cstdint>

namespace cpu_ops {

// Bumped whenever a struct below or the table changes: a form library built from other sources is
// refused by the bindings instead of being called with the wrong layout.
constexpr int32_t kAbiVersion = 13;

enum class DType : int32_t { f32 = 0, bf16 = 1, f16 = 2 };

// Rows [begin, end) of x [rows, hidden]: out = weight * T(h * rsqrt(mean(h^2) + eps)) with h = x,
// or, when residual is not null, residual = T(residual + x) first and h = that sum.
struct NormArgs {
  DType dtype;
  const void* x;
  void* residual;  // [rows, hidden] or null
  const void* weight;  // [hidden]
  void* out;  // [rows, hidden]
  int64_t hidden;
  float eps;
};

// Rows [begin, end): out [rows, width] = silu(gate) * up with gate_up [rows, 2 * width].
struct SiluArgs {
  DType dtype;
  const void* gate_up;
  void* out;
  int64_t width;
};

// Tokens [begin, end) of qkv [tokens, (H + 2 * Hkv) * D]: rotary embedding of the q and k heads in
// place, then the rotated keys and the values written to the caches [blocks, block_size, Hkv, D]
// at slot_mapping[t] (negative: not stored).
struct RotaryArgs {
  DType dtype;
  void* qkv;
  int64_t row_stride;
  const int64_t* positions;
  const void* cos;  // [max_positions, D]
  const void* sin;
  void* k_cache;
  void* v_cache;
  const int64_t* slot_mapping;
  int64_t num_heads, num_kv_heads, head_dim, block_size;
};

// Tasks [begin, end) of `tasks` [n, 5] (sequence, KV head, key_begin, key_end, partial): causal
// attention of the sequence's new tokens over its paged context, every query head of that KV head,
// reading only the keys at positions [key_begin, key_end) (a window narrows them further). partial < 0:
// the task holds all of its tokens' keys, and writes the normalised output. partial >= 0 (a decode
// token's keys split in chunks, one task each): the chunk's unnormalised output, its scores' maximum
// and their sum of exponentials (relative to that maximum) go to slot `partial` of `partials`
// ([slots, group, D + 2]: D sums, the maximum, the sum), and `attention_combine` merges the chunks.
struct AttentionArgs {
  DType dtype;
  const void* q;  // [T, H, D], unit stride on D
  const void* k_cache;  // [blocks, block_size, Hkv, D], contiguous
  const void* v_cache;
  void* out;  // [T, H, D], unit stride on D
  const int32_t* block_tables;  // [B, max_blocks]
  const int32_t* seq_lens;  // [B], new tokens included
  const int32_t* query_start;  // [B + 1]
  const int64_t* tasks;  // [n, 5], as above
  float* partials;  // [slots, group, D + 2]; null when no task is split
  const int64_t* splits;  // [m, 4] (token, KV head, first slot, chunks): the split decode tokens
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t q_row_stride, q_head_stride, out_row_stride, out_head_stride;
  float scale;
  int64_t window;  // > 0: a token attends to the last `window` positions (its own included); 0: all
  float softcap;  // > 0: scores become softcap * tanh(score / softcap) before the softmax; 0: none
};

// Rows [begin, end) of scores [rows, vocab]: the maximum, its first index and log(sum(exp(row))).
struct MaxLogSumExpArgs {
  DType dtype;
  const void* scores;
  int64_t vocab;
  float* values;
  int64_t* indices;
  float* log_normaliser;
};

// One adapted module of a fused projection at one layer, in the tiled pages of
// kernels/lora/layouts.py: a page of A is [hidden_in][16] (bf16: [hidden_in / 2][16][2]), a page of
// B is out_features / 16 blocks of [16 rank rows][16 columns] (bf16: [8 row pairs][16][2]).
struct LoraSlice {
  const void* a_pages;  // [P][hidden_in * 16]
  const void* b_pages;  // [P][out_features * 16]
  const int64_t* ranks;  // [E]: entry e's rank on this module (0: none)
  const int64_t* page_table;  // [E][max_pages]: entry e's pages in rank order
  int64_t max_pages, out_features, column;  // column: the first column of y this slice adds to
};

// Tasks [begin, end) of `tasks` [n, 5] (start, length, entry, part, parts): for each token t of a task's
// rows of entry e and each slice i, with r = slices[i].ranks[e] and A_e, B_e the entry's pages read in
// rank order (kernels.reference.add_lora):
//   y[t, column_i : column_i + out_i] += T((x[t] @ A_e[:r].T) @ B_e[:, :r].T)
// restricted to part `part` of `parts` of each slice's column groups (their even split; the
// bindings cut a heavy segment into tasks of its rows and columns, each task shrinking its own
// rows). float32 weights take any x and y dtype, bf16 weights bf16 x and y.
struct LoraArgs {
  DType dtype;  // of x and y
  DType weight_dtype;  // f32 or bf16
  const void* x;  // [T, hidden_in], contiguous
  void* y;  // [T, total_out], contiguous
  const int64_t* tasks;
  const LoraSlice* slices;
  int64_t num_slices, hidden_in, total_out;
};

// Tasks [begin, end) of out [rows, n] = x [rows, k] @ W.T, float32 sums rounded once to the
// kernel's dtype (float32 or bf16 in and out), W packed by kernels.linear in the kernel's layout.
// Task t = part * groups + group: column group `group` (of `*_groups(args)`) over row part `part` of
// `row_parts`, the parts an even split of the kernel's row tiles (1: every row; more where the
// columns alone leave threads idle). Every output element is the same sum whatever the split.
// While it computes, a matmul requests into cache the memory the next op will read (`fetch_runs`,
// `fetch_lines` lines of 64 bytes in all, none if 0), spread evenly over its column groups: the
// matmul is bound by arithmetic, the ops after it (LoRA over adapter pages, attention over the KV
// cache) by reading memory, which then comes from cache.
struct FetchRun {
  const char* start;
  int64_t lines;
};

struct LinearArgs {
  const void* x;
  const void* packed;
  void* out;
  int64_t rows, k, n;
  const FetchRun* fetch_runs;
  int64_t fetch_lines;
  int64_t row_parts;
};

// Tasks [begin, end): output columns [begin, end) of out [rows, n] (rows `out_stride` apart) =
// x [rows, k] @ W.T, W [n, k] a row of GGML blocks of `ggml_type` per column (kernels/quantized.py),
// x quantized per 32 elements to int8 (scale amax / 127) on the fly, int8 products summed in int32,
// scaled and summed in float32, rounded once to x's dtype (kernels/csrc/quantized.cpp).
struct QuantizedLinearArgs {
  DType dtype;  // of x and out
  int32_t ggml_type;
  const void* x;  // [rows, k], contiguous
  const uint8_t* blocks;  // [n, k / block_elements * block_bytes]
  void* out;
  int64_t rows, k, out_stride;
  bool has_avx_vnni, has_avx512_vnni;  // this CPU's int8 dot product instructions (cpuid)
  int64_t n;  // rows of blocks (columns of out)
};

// Rows [begin, end) of out [rows, k] (float32: kernels.reference.dequantize bit for bit; bf16: that
// rounded once) = the weight rows of GGML blocks.
struct DequantizeArgs {
  DType dtype;  // of out
  int32_t ggml_type;
  const uint8_t* blocks;
  void* out;
  int64_t k;
};

// A compiled-in tuning constant (kernels/tuning.py's CPU_KERNEL_CONSTANTS, generated into the build).
struct Constant {
  const char* name;
  int64_t value;
};

struct KernelTable {
  int32_t abi_version;
  const char* form;  // "generic", "avx2", "avx512", "avx512_bf16" or "amx"
  const char* source_digest;  // of csrc/ and the tuning constants this library was built from
  const Constant* constants;
  int64_t num_constants;
  bool vector_attention;  // attention has this form's vector kernel for head sizes 64 and 128
  void (*rms_norm)(const NormArgs&, int64_t begin, int64_t end);
  void (*silu_and_mul)(const SiluArgs&, int64_t begin, int64_t end);
  void (*rotary_store_kv)(const RotaryArgs&, int64_t begin, int64_t end);
  void (*paged_attention)(const AttentionArgs&, int64_t begin, int64_t end);
  // Splits [begin, end) of `splits`: each query head's output from its chunks' partial results
  // (out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c, chunks in key order).
  void (*attention_combine)(const AttentionArgs&, int64_t begin, int64_t end);
  void (*max_logsumexp)(const MaxLogSumExpArgs&, int64_t begin, int64_t end);
  void (*lora_segments)(const LoraArgs&, int64_t begin, int64_t end);
  // Null where the form has no such matmul. Tasks: `*_groups(args)` column groups of each kernel's
  // call times `args.row_parts`.
  void (*f32_linear)(const LinearArgs&, int64_t begin, int64_t end);
  int64_t (*f32_linear_groups)(const LinearArgs& args);
  void (*bf16_linear)(const LinearArgs&, int64_t begin, int64_t end);
  int64_t (*bf16_linear_groups)(const LinearArgs& args);
  // The AMX kernel: each task range configures and releases its own tiles (tile state is per thread).
  void (*amx_linear)(const LinearArgs&, int64_t begin, int64_t end);
  int64_t (*amx_linear_groups)(const LinearArgs& args);
  // FLOP/s of `iterations` rounds of independent multiply-add chains of this form's widest
  // instruction (the roofline's instruction peak), or 0 where it has no such probe.
  double (*peak_flops)(const char* kind, int64_t iterations, double seed);
  // Bytes per second of one pass reading `bytes` of `data` (64-byte aligned) as `streams` (1, 2, 4
  // or 8) interleaved sequential streams, with this form's widest loads (the roofline's bandwidth);
  // 0 for another number of streams.
  double (*peak_read)(const void* data, int64_t bytes, int64_t streams);
  // Quantized weights (kernels/csrc/quantized.cpp); `quantized_int8_dot` names the instruction the
  // matmul multiplies with under these args ("avx512_vnni", "avx_vnni", "widening" or "portable").
  void (*quantized_linear)(const QuantizedLinearArgs&, int64_t begin, int64_t end);
  const char* (*quantized_int8_dot)(const QuantizedLinearArgs& args);
  void (*dequantize_rows)(const DequantizeArgs&, int64_t begin, int64_t end);
  // bf16 x by weights widened to bf16 in groups of 32 rows on the form's tiles (quantized_tiles.cpp);
  // tasks: groups of 32 output columns.
  void (*quantized_linear_widened)(const QuantizedLinearArgs&, int64_t begin, int64_t end);
  // The same matmul as quantized_linear (x quantized per 32 elements) on AMX-INT8 tiles
  // (quantized_amx.cpp); null where the form has no AMX-INT8. Tasks: groups of 32 output columns.
  void (*quantized_linear_amx)(const QuantizedLinearArgs&, int64_t begin, int64_t end);
};

}  // namespace cpu_ops

extern "C" const cpu_ops::KernelTable* lora_serve_kernel_table();
