// The Python bindings of the compiled CPU ops (the extension `kernels._cpu_ops`), built once with
// PyTorch's headers and the baseline flags of the platform. They check every tensor, split each op's
// work over PyTorch's thread pool, and call the kernels of the active instruction-set form: a shared
// library per form (`kernels/_cpu_isa_<form>*.so`, see setup.py), loaded with `load_form` and chosen
// with `use_form`, as PyTorch and oneDNN choose their kernels by the CPU's features at run time.
// Which forms this CPU can run is read from `cpuid` here (`supported_forms`).
#include <dlfcn.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "kernel_table.h"
#include "lora_serve_tuning.h"
#include "task_plans.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using cpu_ops::DType;
using cpu_ops::KernelTable;

std::map<std::string, const KernelTable*>& loaded_forms() {
  static std::map<std::string, const KernelTable*> forms;
  return forms;
}

const KernelTable* active = nullptr;

const KernelTable& table() {
  TORCH_CHECK(active != nullptr, "no compiled CPU op form is active (kernels.cpu_ops loads one at import)");
  return *active;
}

#if defined(__x86_64__)
uint64_t enabled_state_components() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

bool bit(uint32_t word, int index) { return (word >> index) & 1u; }

// Linux grants the AMX tile state only to processes that ask for it (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); the grant is process-wide and permanent.
bool amx_permission_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}
#endif

// The forms this CPU and its operating system can run, in the order of preference.
std::vector<std::string> supported_forms() {
  std::vector<std::string> forms{"generic"};
#if defined(__x86_64__)
  uint32_t eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !bit(ecx, 27)) return forms;  // no OSXSAVE: no xgetbv
  const bool fma = bit(ecx, 12), avx = bit(ecx, 28), f16c = bit(ecx, 29);
  const uint64_t state = enabled_state_components();
  const bool ymm_state = (state & 0x6) == 0x6, zmm_state = (state & 0xe6) == 0xe6;
  const bool tile_state = (state & 0x60000) == 0x60000;
  uint32_t leaf7_ebx = 0, leaf7_edx = 0, leaf7_1_eax = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
    leaf7_ebx = ebx;
    leaf7_edx = edx;
    if (eax >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) leaf7_1_eax = eax;
  }
  const bool avx2 = avx && fma && f16c && bit(leaf7_ebx, 5) && bit(leaf7_ebx, 8) && ymm_state;
  const bool avx512 = avx2 && zmm_state && bit(leaf7_ebx, 16) && bit(leaf7_ebx, 17) && bit(leaf7_ebx, 28) &&
                      bit(leaf7_ebx, 30) && bit(leaf7_ebx, 31);
  const bool avx512_bf16 = avx512 && bit(leaf7_1_eax, 5);
  const bool amx = avx512_bf16 && tile_state && bit(leaf7_edx, 22) && bit(leaf7_edx, 24) && amx_permission_granted();
  if (avx2) forms.push_back("avx2");
  if (avx512) forms.push_back("avx512");
  if (avx512_bf16) forms.push_back("avx512_bf16");
  if (amx) forms.push_back("amx");
#endif
  return forms;
}

// Loads a form's library (without exposing its symbols to anything else) and returns its name.
std::string load_form(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(handle != nullptr, "cannot load ", path, ": ", dlerror());
  using Getter = const KernelTable* (*)();
  auto getter = reinterpret_cast<Getter>(dlsym(handle, "lora_serve_kernel_table"));
  TORCH_CHECK(getter != nullptr, path, " exports no kernel table");
  const KernelTable* loaded = getter();
  TORCH_CHECK(loaded->abi_version == cpu_ops::kAbiVersion, path, " was built for kernel table version ",
              loaded->abi_version, ", these bindings expect ", cpu_ops::kAbiVersion);
  loaded_forms()[loaded->form] = loaded;
  return loaded->form;
}

void use_form(const std::string& form) {
  auto found = loaded_forms().find(form);
  TORCH_CHECK(found != loaded_forms().end(), "compiled CPU op form ", form, " is not loaded");
  active = found->second;
}

std::string active_form() { return active ? active->form : ""; }

// Whether these bindings were compiled with OpenMP, so that `at::parallel_for` (an OpenMP region
// inlined from PyTorch's headers) runs its tasks on PyTorch's threads rather than serially.
bool is_parallel() {
#if defined(_OPENMP)
  return true;
#else
  return false;
#endif
}

std::string source_digest() { return std::string(table().source_digest); }

bool has_vector_attention() { return table().vector_attention; }

std::vector<std::string> linear_kernels() {
  std::vector<std::string> kinds;
  if (table().amx_linear) kinds.push_back("amx");
  if (table().bf16_linear) kinds.push_back("bf16");
  if (table().f32_linear) kinds.push_back("f32");
  return kinds;
}

std::map<std::string, int64_t> constants() {
  std::map<std::string, int64_t> values;
  for (int64_t i = 0; i < table().num_constants; ++i) values[table().constants[i].name] = table().constants[i].value;
  return values;
}

DType dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    default: TORCH_CHECK(false, "compiled CPU ops take float32, bfloat16 or float16, not ", t.scalar_type());
  }
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous CPU [rows, width] tensor");
}

// Tasks [0, num_tasks) over PyTorch's thread pool, at least `grain` tasks a thread: at::parallel_for
// gives each thread one contiguous range of them.
template <typename Args, typename Kernel>
void run_tasks(Kernel kernel, const Args& args, int64_t num_tasks, int64_t grain) {
  TORCH_CHECK(kernel != nullptr, "this form has no such kernel");
  at::parallel_for(0, num_tasks, grain, [&](int64_t begin, int64_t end) { kernel(args, begin, end); });
}

// Tasks whose costs differ: thread t runs tasks [starts[t], starts[t + 1]) (cpu_ops::balance_tasks).
template <typename Args, typename Kernel>
void run_balanced(Kernel kernel, const Args& args, const std::vector<int64_t>& starts) {
  TORCH_CHECK(kernel != nullptr, "this form has no such kernel");
  const int64_t num_threads = static_cast<int64_t>(starts.size()) - 1;
  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      if (starts[t] < starts[t + 1]) kernel(args, starts[t], starts[t + 1]);
  });
}

// Rows a task of a per-row op whose rows hold `width` elements: enough elements that a task's work
// outweighs handing it to a thread, so that a small batch stays on fewer threads.
int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, cpu_ops::tuning::kRowTaskMinElements / std::max<int64_t>(1, width));
}

void norm(torch::Tensor out, torch::Tensor x, const torch::Tensor* residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.numel() == x.size(1) && weight.is_contiguous(),
              "shapes of out, x and weight disagree");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(), "one dtype expected");
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(), "residual must match x");
  }
  const cpu_ops::NormArgs args{dtype_of(x), x.data_ptr(), residual ? residual->data_ptr() : nullptr, weight.data_ptr(),
                               out.data_ptr(), x.size(1), static_cast<float>(eps)};
  run_tasks(table().rms_norm, args, x.size(0), row_grain(x.size(1)));
}

void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) { norm(out, x, nullptr, weight, eps); }

void add_rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  norm(out, x, &residual, weight, eps);
}

void silu_and_mul(torch::Tensor out, torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  check_rows(out, "out");
  TORCH_CHECK(gate_up.size(0) == out.size(0) && gate_up.size(1) == 2 * out.size(1), "gate_up must be [rows, 2 * width]");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "one dtype expected");
  const cpu_ops::SiluArgs args{dtype_of(out), gate_up.data_ptr(), out.data_ptr(), out.size(1)};
  run_tasks(table().silu_and_mul, args, out.size(0), row_grain(gate_up.size(1)));
}

void rotary_store_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                     torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t num_heads,
                     int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [tokens, (H + 2 * Hkv) * D] with unit column stride");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(), "cos and sin: [positions, D]");
  const int64_t head_dim = cos.size(1);
  TORCH_CHECK(head_dim % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "qkv width disagrees");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 4 && k_cache.size(2) == num_kv_heads && k_cache.size(3) == head_dim,
              "caches must be contiguous [blocks, block_size, Hkv, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() &&
                  positions.numel() == qkv.size(0) && slot_mapping.numel() == qkv.size(0),
              "positions and slot_mapping: contiguous int64 [tokens]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
                  k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "one dtype expected");
  const cpu_ops::RotaryArgs args{dtype_of(qkv), qkv.data_ptr(), qkv.stride(0), positions.data_ptr<int64_t>(),
                                 cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                 slot_mapping.data_ptr<int64_t>(), num_heads, num_kv_heads, head_dim, k_cache.size(1)};
  run_tasks(table().rotary_store_kv, args, qkv.size(0), row_grain(qkv.size(1)));
}

// The new tokens and keys of each sequence in `seqs` (indices into seq_lens and query_start).
std::vector<cpu_ops::SequenceKeys> sequence_keys(const torch::Tensor& seqs, const torch::Tensor& seq_lens,
                                                 const torch::Tensor& query_start, int64_t window) {
  const int64_t* seq_of = seqs.data_ptr<int64_t>();
  const int32_t *ctx_of = seq_lens.data_ptr<int32_t>(), *start_of = query_start.data_ptr<int32_t>();
  std::vector<cpu_ops::SequenceKeys> sequences;
  for (int64_t i = 0; i < seqs.numel(); ++i) {
    const int64_t seq = seq_of[i];
    TORCH_CHECK(seq >= 0 && seq < seq_lens.numel() && seq + 1 < query_start.numel(), "seqs[", i, "] names no sequence");
    const int64_t ctx = ctx_of[seq], q_len = start_of[seq + 1] - start_of[seq];
    TORCH_CHECK(q_len >= 0 && q_len <= ctx, "sequence ", seq, " has more new tokens than keys");
    sequences.push_back({seq, start_of[seq], q_len, window > 0 ? std::max<int64_t>(0, ctx - q_len + 1 - window) : 0, ctx});
  }
  return sequences;
}

void paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                     torch::Tensor seq_lens, torch::Tensor query_start, torch::Tensor seqs, double scale,
                     torch::Tensor out, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap are >= 0 (0: none)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4, "caches must be contiguous");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1,
              "q and out: [T, H, D] with head_dim contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(), "q, caches and out must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start.scalar_type() == at::kInt && seqs.scalar_type() == at::kLong,
              "block_tables, seq_lens, query_start are int32 and seqs int64");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() && query_start.is_contiguous() &&
                  seqs.is_contiguous(), "index tensors must be contiguous");
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(q.size(1) % num_kv_heads == 0 && k_cache.size(3) == q.size(2), "heads or head_dim disagree");
  const cpu_ops::AttentionPlan plan = cpu_ops::plan_attention(
      sequence_keys(seqs, seq_lens, query_start, window), num_kv_heads, at::get_num_threads());
  torch::Tensor partials;  // [slots, group, D + 2] float32, where a decode token's keys are split
  if (plan.num_slots > 0) partials = torch::empty({plan.num_slots, q.size(1) / num_kv_heads, q.size(2) + 2}, q.options().dtype(at::kFloat));
  const cpu_ops::AttentionArgs args{dtype_of(q), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                                    block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                                    query_start.data_ptr<int32_t>(), plan.tasks.data(),
                                    plan.num_slots > 0 ? partials.data_ptr<float>() : nullptr, plan.splits.data(),
                                    q.size(1), num_kv_heads, q.size(2), k_cache.size(1), block_tables.size(1),
                                    q.stride(0), q.stride(1), out.stride(0), out.stride(1), static_cast<float>(scale),
                                    window, static_cast<float>(softcap)};
  run_balanced(table().paged_attention, args, plan.starts);
  if (!plan.splits.empty()) run_tasks(table().attention_combine, args, static_cast<int64_t>(plan.splits.size() / 4), 1);
}

void max_logsumexp(torch::Tensor scores, torch::Tensor values, torch::Tensor indices, torch::Tensor log_normaliser) {
  check_rows(scores, "scores");
  TORCH_CHECK(scores.size(1) > 0, "scores need at least one column");
  const int64_t rows = scores.size(0);
  TORCH_CHECK(values.numel() == rows && indices.numel() == rows && log_normaliser.numel() == rows &&
                  values.scalar_type() == at::kFloat && log_normaliser.scalar_type() == at::kFloat &&
                  indices.scalar_type() == at::kLong && values.is_contiguous() && indices.is_contiguous() &&
                  log_normaliser.is_contiguous(),
              "outputs: float32 values and log_normaliser, int64 indices, one per row");
  const cpu_ops::MaxLogSumExpArgs args{dtype_of(scores), scores.data_ptr(), scores.size(1), values.data_ptr<float>(),
                                       indices.data_ptr<int64_t>(), log_normaliser.data_ptr<float>()};
  run_tasks(table().max_logsumexp, args, rows, 1);
}

// The LoRA op's tasks (LoraArgs::tasks, [n][5]) and each thread's share: thread t runs tasks
// [starts[t], starts[t + 1]).
struct LoraPlan {
  std::vector<int64_t> tasks;
  std::vector<int64_t> starts;
};

// FLOPs of one token of an entry in one slice: its shrink (its pages of A over hidden_in) and its
// expand (its rank rows of B over the slice's columns), ranks rounded up to the pages the kernel reads.
struct SliceCost {
  double shrink = 0, expand = 0, columns = 0;
};

std::vector<SliceCost> token_costs(const std::vector<cpu_ops::LoraSlice>& slices, int64_t entry, int64_t hidden_in) {
  std::vector<SliceCost> costs;
  for (const cpu_ops::LoraSlice& slice : slices) {
    const double rank = static_cast<double>((slice.ranks[entry] + 15) / 16 * 16);
    const double columns = static_cast<double>(slice.out_features);
    costs.push_back({2 * rank * static_cast<double>(hidden_in), 2 * rank * columns, columns});
  }
  return costs;
}

// FLOPs of one token in part `part` of `parts` of the columns of every slice in slice order (as
// lora.cpp splits them, up to its column groups): the expand of its columns and the shrink of every
// slice it touches (a part reads x and A again for each).
double part_cost(const std::vector<SliceCost>& costs, int64_t part, int64_t parts) {
  double total = 0, cost = 0, start = 0;
  for (const SliceCost& slice : costs) total += slice.columns;
  const double first = total * static_cast<double>(part) / static_cast<double>(parts);
  const double end = total * static_cast<double>(part + 1) / static_cast<double>(parts);
  for (const SliceCost& slice : costs) {
    const double overlap = std::min(end, start + slice.columns) - std::max(first, start);
    if (overlap > 0 && slice.expand > 0) cost += slice.shrink + slice.expand * overlap / slice.columns;
    start += slice.columns;
  }
  return cost;
}

// The column parts of `rows` tokens: the count for which the heaviest part (counted as no lighter
// than `bar`, kLoraColumnSplitSharePercent of a thread's share of the call: below it, the cost-balanced
// ranges even out the tasks without more work) plus the work the split adds, spread over the threads,
// is least. Each part shrinks again every slice it touches, and a wide input's shrink outweighs a
// narrow output's expand: cutting only by the heaviest part had the output and down projections of
// workload W's decode do 3-4x their one-thread FLOPs on two threads.
int64_t column_parts(const std::vector<SliceCost>& costs, double rows, double bar, int64_t max_parts,
                     int64_t num_threads) {
  const double whole = rows * part_cost(costs, 0, 1);
  int64_t best = 1;
  double best_score = std::max(whole, bar);
  for (int64_t parts = 2; parts <= max_parts; ++parts) {
    double heaviest = 0, total = 0;
    for (int64_t part = 0; part < parts; ++part) {
      const double cost = rows * part_cost(costs, part, parts);
      heaviest = std::max(heaviest, cost);
      total += cost;
    }
    const double extra = (total - whole) / static_cast<double>(num_threads);
    if (std::max(heaviest, bar) + extra < best_score) best = parts, best_score = std::max(heaviest, bar) + extra;
    // More parts only add work once the heaviest is at the bar, or once the work they add alone
    // outweighs the best score (it grows with the parts): the search stops there, as it runs
    // serially before the op (a wide projection has dozens of candidate counts).
    if (heaviest <= bar || bar + extra >= best_score) break;
  }
  return best;
}

// Adds the tasks of one segment (start, length, entry) to `plan`, with their costs: its rows cut into
// pieces and, where a piece (a few decode tokens on a rank-64 adapter) still outweighs `target`, its
// columns into parts: a heavy segment is not one task.
void add_segment_tasks(const int64_t* segment, const std::vector<SliceCost>& costs, double target, double bar,
                       int64_t max_parts, int64_t num_threads, LoraPlan& plan, std::vector<double>& task_costs) {
  const int64_t length = segment[1], quantum = cpu_ops::tuning::kLoraMinRowsPerTask;
  const int64_t quanta = std::max<int64_t>(1, (length + quantum - 1) / quantum);
  const double whole = static_cast<double>(length) * part_cost(costs, 0, 1);
  const int64_t pieces = std::clamp<int64_t>(static_cast<int64_t>(std::ceil(whole / target)), 1, quanta);
  for (int64_t piece = 0; piece < pieces; ++piece) {
    const int64_t first = std::min(length, quanta * piece / pieces * quantum);
    const double rows = static_cast<double>(std::min(length, quanta * (piece + 1) / pieces * quantum) - first);
    const int64_t parts = rows * part_cost(costs, 0, 1) > bar ? column_parts(costs, rows, bar, max_parts, num_threads) : 1;
    for (int64_t part = 0; part < parts; ++part) {
      plan.tasks.insert(plan.tasks.end(), {segment[0] + first, static_cast<int64_t>(rows), segment[2], part, parts});
      task_costs.push_back(rows * part_cost(costs, part, parts));
    }
  }
}

// The tasks of `n` segments [n][3] and their split over PyTorch's threads: tasks of about
// 1 / kLoraTasksPerThread of a thread's share (never below kLoraMinTaskFlops), regrouped into one
// range a thread of about equal FLOPs (cpu_ops::balance_tasks). On one thread: the segments as they are.
LoraPlan plan_lora(const int64_t* segments, int64_t n, const std::vector<cpu_ops::LoraSlice>& slices, int64_t hidden_in) {
  const int64_t num_threads = at::get_num_threads();
  std::vector<std::vector<SliceCost>> cost_of(n);
  double total = 0;
  int64_t columns = 0;
  for (const cpu_ops::LoraSlice& slice : slices) columns += slice.out_features;
  for (int64_t s = 0; s < n; ++s) {
    cost_of[s] = token_costs(slices, segments[3 * s + 2], hidden_in);
    total += static_cast<double>(segments[3 * s + 1]) * part_cost(cost_of[s], 0, 1);
  }
  const double target = num_threads == 1 ? INFINITY
                        : std::max(total / static_cast<double>(num_threads * cpu_ops::tuning::kLoraTasksPerThread),
                                   static_cast<double>(cpu_ops::tuning::kLoraMinTaskFlops));
  const int64_t max_parts = std::max<int64_t>(1, columns / cpu_ops::tuning::kLoraMinColumnsPerPart);
  const double bar = num_threads == 1 ? INFINITY
                                    : total / static_cast<double>(num_threads) *
                                          static_cast<double>(cpu_ops::tuning::kLoraColumnSplitSharePercent) / 100;
  LoraPlan plan;
  std::vector<double> costs;
  for (int64_t s = 0; s < n; ++s) add_segment_tasks(segments + 3 * s, cost_of[s], target, bar, max_parts, num_threads, plan, costs);
  plan.starts = cpu_ops::balance_tasks(plan.tasks, 5, costs, num_threads);
  return plan;
}

// Per slice of the fused projection: its layer's tiled pages a [P, hidden_in * 16] and
// b [P, out * 16] (kernels/lora/layouts.py, float32 or bf16), the step's ranks [E] and page tables
// [E, max_pages] of its module, and the first column of y it adds to; slices tile y's columns.
void lora_segments(torch::Tensor y, torch::Tensor x, torch::Tensor segments, std::vector<torch::Tensor> a_pages,
                   std::vector<torch::Tensor> b_pages, std::vector<torch::Tensor> ranks,
                   std::vector<torch::Tensor> page_tables, std::vector<int64_t> columns) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.is_contiguous() && y.is_contiguous() && x.size(0) == y.size(0),
              "x [T, in] and y [T, out] must be contiguous with the same rows");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y must share a dtype");
  const size_t num_slices = a_pages.size();
  TORCH_CHECK(num_slices >= 1 && b_pages.size() == num_slices && ranks.size() == num_slices &&
                  page_tables.size() == num_slices && columns.size() == num_slices,
              "one a, b, ranks, page table and column per slice");
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 3 && segments.scalar_type() == at::kLong && segments.is_contiguous(),
              "segments must be int64 [n, 3] (start, length, entry)");
  const DType weight_dtype = dtype_of(a_pages[0]);
  TORCH_CHECK(weight_dtype != DType::f16, "the adapter pages are float32 or bf16");
  TORCH_CHECK(weight_dtype == DType::f32 || x.scalar_type() == at::kBFloat16, "bf16 adapter pages take bf16 x and y");
  const int64_t hidden_in = x.size(1);
  TORCH_CHECK(weight_dtype == DType::f32 || hidden_in % 2 == 0, "bf16 pages need an even hidden_in");
  int64_t num_entries = -1;
  std::vector<cpu_ops::LoraSlice> slices;
  for (size_t i = 0; i < num_slices; ++i) {
    const torch::Tensor &a = a_pages[i], &b = b_pages[i], &rank = ranks[i], &table = page_tables[i];
    TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.is_contiguous() && b.is_contiguous() && a.size(0) == b.size(0),
                "slice ", i, ": pages must be contiguous [P, elements], as many of A as of B");
    TORCH_CHECK(a.scalar_type() == a_pages[0].scalar_type() && b.scalar_type() == a.scalar_type(),
                "every slice's pages share one dtype");
    TORCH_CHECK(a.size(1) == hidden_in * 16 && b.size(1) % 256 == 0, "slice ", i,
                ": a page of A holds hidden_in x 16 elements, one of B whole blocks of 16 x 16");
    const int64_t out_features = b.size(1) / 16;
    TORCH_CHECK(columns[i] >= 0 && columns[i] + out_features <= y.size(1), "slice ", i, " lies outside y's columns");
    TORCH_CHECK(rank.dim() == 1 && table.dim() == 2 && rank.scalar_type() == at::kLong &&
                    table.scalar_type() == at::kLong && rank.is_contiguous() && table.is_contiguous() &&
                    table.size(0) == rank.size(0) && table.size(1) >= 1,
                "slice ", i, ": ranks int64 [E] and page table int64 [E, max_pages]");
    TORCH_CHECK(num_entries < 0 || rank.size(0) == num_entries, "every slice has the same entries");
    num_entries = rank.size(0);
    const int64_t* rank_of = rank.data_ptr<int64_t>();
    const int64_t* pages = table.data_ptr<int64_t>();
    for (int64_t e = 0; e < num_entries; ++e) {
      TORCH_CHECK(rank_of[e] >= 0 && rank_of[e] <= table.size(1) * 16, "slice ", i, ": entry ", e,
                  "'s rank needs more pages than its table holds");
      for (int64_t p = 0; p < (rank_of[e] + 15) / 16; ++p)
        TORCH_CHECK(pages[e * table.size(1) + p] >= 0 && pages[e * table.size(1) + p] < a.size(0), "slice ", i,
                    ": entry ", e, " names a page outside the pool");
    }
    slices.push_back({a.data_ptr(), b.data_ptr(), rank_of, pages, table.size(1), out_features, columns[i]});
  }
  const int64_t* segment = segments.data_ptr<int64_t>();
  for (int64_t s = 0; s < segments.size(0); ++s, segment += 3)
    TORCH_CHECK(segment[0] >= 0 && segment[1] >= 0 && segment[0] + segment[1] <= x.size(0) && segment[2] >= 0 &&
                    segment[2] < num_entries, "segment ", s, " lies outside the tokens or the entries");
  TORCH_CHECK(table().lora_segments != nullptr, "this form has no such kernel");
  const LoraPlan plan = plan_lora(segments.data_ptr<int64_t>(), segments.size(0), slices, hidden_in);
  const cpu_ops::LoraArgs args{dtype_of(x), weight_dtype, x.data_ptr(), y.data_ptr(), plan.tasks.data(),
                               slices.data(), static_cast<int64_t>(num_slices), hidden_in, y.size(1)};
  run_balanced(table().lora_segments, args, plan.starts);
}

void check_linear(const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& packed, at::ScalarType dtype) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == dtype, "x must be contiguous [M, K] of the kernel's dtype");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == dtype && out.size(0) == x.size(0),
              "out must be contiguous [M, N] of the kernel's dtype");
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == dtype && packed.numel() == out.size(1) * x.size(1),
              "packed must be the contiguous packed form of an [N, K] weight of the kernel's dtype");
}

// The pages the op after a matmul reads: page ids[j] of pools[j], each pool contiguous with its
// pages along dim 0, as runs of 64-byte lines (prefetching cannot fault, but a page outside its pool
// is a caller's mistake worth stopping).
std::vector<cpu_ops::FetchRun> page_runs(const std::vector<torch::Tensor>& pools, const std::vector<torch::Tensor>& ids) {
  TORCH_CHECK(pools.size() == ids.size(), "one page-id tensor per fetched pool");
  std::vector<cpu_ops::FetchRun> runs;
  for (size_t j = 0; j < pools.size(); ++j) {
    const torch::Tensor& pool = pools[j];
    const torch::Tensor& pages = ids[j];
    TORCH_CHECK(pool.device().is_cpu() && pool.dim() >= 1 && pool.is_contiguous(), "fetched pools must be contiguous CPU tensors");
    TORCH_CHECK(pages.dim() == 1 && pages.scalar_type() == at::kLong && pages.is_contiguous(), "page ids must be 1-D int64");
    const int64_t page_bytes = pool.stride(0) * pool.element_size(), lines = (page_bytes + 63) / 64;
    const char* base = static_cast<const char*>(pool.data_ptr());
    const int64_t* page = pages.data_ptr<int64_t>();
    for (int64_t i = 0; i < pages.numel(); ++i) {
      TORCH_CHECK(page[i] >= 0 && page[i] < pool.size(0), "page id ", page[i], " lies outside its pool");
      if (lines > 0) runs.push_back({base + page[i] * page_bytes, lines});
    }
  }
  return runs;
}

// Row parts of a matmul of `groups` column groups over `rows` rows (LinearArgs): one while the groups
// give every thread kLinearMinGroupsPerThread of them (a part re-reads all its columns' weights),
// else enough parts that they do, each of at least kLinearMinRowsPerPart rows.
int64_t linear_row_parts(int64_t groups, int64_t rows) {
  const int64_t wanted = at::get_num_threads() * cpu_ops::tuning::kLinearMinGroupsPerThread;
  if (at::get_num_threads() == 1 || groups >= wanted) return 1;
  const int64_t most = std::max<int64_t>(1, rows / cpu_ops::tuning::kLinearMinRowsPerPart);
  return std::min<int64_t>((wanted + groups - 1) / groups, most);
}

template <typename Kernel, typename Groups>
void run_linear(Kernel kernel, Groups groups, const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& packed,
                int64_t rows, const std::vector<torch::Tensor>& fetch_pools, const std::vector<torch::Tensor>& fetch_pages) {
  std::vector<cpu_ops::FetchRun> runs = page_runs(fetch_pools, fetch_pages);
  int64_t lines = 0;
  for (const cpu_ops::FetchRun& run : runs) lines += run.lines;
  if (2 * rows * x.size(1) * out.size(1) < cpu_ops::tuning::kFetchMinFlopsPerByte * 64 * lines) runs.clear(), lines = 0;
  cpu_ops::LinearArgs args{x.data_ptr(), packed.data_ptr(), out.data_ptr(), rows, x.size(1), out.size(1),
                           runs.empty() ? nullptr : runs.data(), lines, 1};
  const int64_t num_groups = groups(args);
  args.row_parts = linear_row_parts(num_groups, rows);
  run_tasks(kernel, args, num_groups * args.row_parts, 1);
}

void f32_linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed, std::vector<torch::Tensor> fetch_pools,
                std::vector<torch::Tensor> fetch_pages) {
  check_linear(out, x, packed, at::kFloat);
  TORCH_CHECK(out.size(1) % 16 == 0, "N must be a multiple of 16");
  TORCH_CHECK(table().f32_linear != nullptr, "the active form has no float32 matmul");
  run_linear(table().f32_linear, table().f32_linear_groups, out, x, packed, x.size(0), fetch_pools, fetch_pages);
}

void bf16_linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed, std::vector<torch::Tensor> fetch_pools,
                 std::vector<torch::Tensor> fetch_pages) {
  check_linear(out, x, packed, at::kBFloat16);
  TORCH_CHECK(x.size(1) % 2 == 0 && out.size(1) % 16 == 0, "K must be even and N a multiple of 16");
  TORCH_CHECK(table().bf16_linear != nullptr, "the active form has no bf16 matmul");
  run_linear(table().bf16_linear, table().bf16_linear_groups, out, x, packed, x.size(0), fetch_pools, fetch_pages);
}

void amx_linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed, std::vector<torch::Tensor> fetch_pools,
                std::vector<torch::Tensor> fetch_pages) {
  check_linear(out, x, packed, at::kBFloat16);
  TORCH_CHECK(x.size(1) % 32 == 0 && out.size(1) % 32 == 0, "K and N must be multiples of 32");
  TORCH_CHECK(table().amx_linear != nullptr, "the active form has no AMX matmul");
  if (x.size(1) == 0) {  // sums of nothing: the tiles would load from an empty x
    out.zero_();
    return;
  }
  // x in the kernel's tiles (amx_linear.cpp): x_tiles[row_block][k_step][32][32], padded with zero
  // rows to whole blocks of 32.
  const int64_t rows = x.size(0), k = x.size(1), row_blocks = (rows + 31) / 32;
  torch::Tensor tiles = torch::empty({row_blocks, k / 32, 32, 32}, x.options());
  const int64_t whole = rows / 32;
  if (whole > 0) tiles.narrow(0, 0, whole).copy_(x.narrow(0, 0, whole * 32).view({whole, 32, k / 32, 32}).permute({0, 2, 1, 3}));
  if (whole != row_blocks) {
    torch::Tensor last = torch::zeros({32, k}, x.options());
    last.narrow(0, 0, rows - whole * 32).copy_(x.narrow(0, whole * 32, rows - whole * 32));
    tiles.select(0, whole).copy_(last.view({32, k / 32, 32}).permute({1, 0, 2}));
  }
  run_linear(table().amx_linear, table().amx_linear_groups, out, tiles.view({row_blocks * 32, k}), packed, rows,
             fetch_pools, fetch_pages);
}

double peak_flops(const std::string& kind, int64_t iterations, double seed) {
  return table().peak_flops(kind.c_str(), iterations, seed);
}

double peak_read(const torch::Tensor& buffer, int64_t streams) {
  TORCH_CHECK(buffer.device().is_cpu() && buffer.is_contiguous(), "peak_read reads a contiguous CPU tensor");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(buffer.data_ptr()) % 64 == 0,
              "peak_read reads whole lines: align the buffer to 64 bytes");
  TORCH_CHECK(streams == 1 || streams == 2 || streams == 4 || streams == 8, "peak_read reads 1, 2, 4 or 8 streams");
  TORCH_CHECK(buffer.nbytes() >= static_cast<size_t>(64 * streams), "peak_read reads at least a line a stream");
  return table().peak_read(buffer.data_ptr(), static_cast<int64_t>(buffer.nbytes()), streams);
}

// The int8 dot product instructions of this CPU, which no form's flags imply (quantized.cpp picks
// by them within its form): AVX512-VNNI (cpuid 7.0 ecx bit 11), AVX-VNNI (7.1 eax bit 4). Off while
// `use_vnni(false)` holds, so that tests and benchmarks can run the widening path here too.
bool vnni_allowed = true;

cpu_ops::QuantizedLinearArgs int8_dots(cpu_ops::QuantizedLinearArgs args) {
#if defined(__x86_64__)
  uint32_t eax, ebx, ecx, edx;
  if (vnni_allowed && __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
    args.has_avx512_vnni = bit(ecx, 11);
    if (eax >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) args.has_avx_vnni = bit(eax, 4);
  }
#endif
  return args;
}

bool use_vnni(bool allowed) {
  const bool previous = vnni_allowed;
  vnni_allowed = allowed;
  return previous;
}

std::string quantized_int8_dot() { return table().quantized_int8_dot(int8_dots({})); }

// Whether quantized_linear_amx runs here: the active form has it, and this CPU has AMX-INT8 (cpuid
// 7.0 edx bit 25; the AMX form needs AMX-BF16, and no CPU is bound to have both) and grants the tile
// state. Read once: `cpuid` traps to the hypervisor in a virtual machine, and this is asked per call.
bool cpu_has_amx_int8() {
#if defined(__x86_64__)
  static const bool has = [] {
    uint32_t eax, ebx, ecx, edx;
    return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && bit(edx, 25) && amx_permission_granted();
  }();
  return has;
#else
  return false;
#endif
}

bool has_quantized_amx() { return table().quantized_linear_amx != nullptr && cpu_has_amx_int8(); }

// GGML block type number -> (elements, bytes) of a block (kernels/quantized.py BLOCK_TYPES).
std::pair<int64_t, int64_t> ggml_block(int64_t ggml_type) {
  static const std::map<int64_t, std::pair<int64_t, int64_t>> blocks{
      {2, {32, 18}}, {3, {32, 20}}, {8, {32, 34}}, {12, {256, 144}}, {13, {256, 176}}, {14, {256, 210}}};
  auto found = blocks.find(ggml_type);
  TORCH_CHECK(found != blocks.end(), "no compiled kernel for GGML type ", ggml_type);
  return found->second;
}

void check_blocks(const torch::Tensor& blocks, int64_t ggml_type, int64_t k) {
  const auto [elements, bytes] = ggml_block(ggml_type);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be a contiguous uint8 CPU [rows, row_bytes] tensor");
  TORCH_CHECK(k % elements == 0 && blocks.size(1) == k / elements * bytes, "blocks' row bytes disagree with k and the type");
}

cpu_ops::QuantizedLinearArgs quantized_args(torch::Tensor out, torch::Tensor x, torch::Tensor blocks, int64_t ggml_type) {
  check_rows(x, "x");
  check_blocks(blocks, ggml_type, x.size(1));
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == blocks.size(0) &&
                  out.scalar_type() == x.scalar_type(), "out must be [rows of x, rows of blocks] of x's dtype, unit column stride");
  return {dtype_of(x), static_cast<int32_t>(ggml_type), x.data_ptr(), blocks.data_ptr<uint8_t>(), out.data_ptr(),
          x.size(0), x.size(1), out.stride(0), false, false, blocks.size(0)};
}

void quantized_linear(torch::Tensor out, torch::Tensor x, torch::Tensor blocks, int64_t ggml_type) {
  const cpu_ops::QuantizedLinearArgs args = quantized_args(out, x, blocks, ggml_type);
  if (x.size(0) == 0) return;
  run_tasks(table().quantized_linear, int8_dots(args), blocks.size(0), row_grain(x.size(0) * x.size(1)));
}

// Tasks: groups of 32 output columns, each widened once into L2 for all rows (quantized_tiles.cpp).
void quantized_linear_widened(torch::Tensor out, torch::Tensor x, torch::Tensor blocks, int64_t ggml_type) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "the widened quantized matmul takes bf16 x");
  const cpu_ops::QuantizedLinearArgs args = quantized_args(out, x, blocks, ggml_type);
  if (x.size(0) == 0) return;
  run_tasks(table().quantized_linear_widened, args, (blocks.size(0) + 31) / 32, 1);
}

// Tasks: groups of 32 output columns, each unpacked once into L2 for all rows (quantized_amx.cpp).
void quantized_linear_amx(torch::Tensor out, torch::Tensor x, torch::Tensor blocks, int64_t ggml_type) {
  TORCH_CHECK(has_quantized_amx(), "the active form or this CPU has no AMX-INT8 matmul");
  const cpu_ops::QuantizedLinearArgs args = quantized_args(out, x, blocks, ggml_type);
  if (x.size(0) == 0) return;
  run_tasks(table().quantized_linear_amx, args, (blocks.size(0) + 31) / 32, 1);
}

void dequantize_rows(torch::Tensor out, torch::Tensor blocks, int64_t ggml_type) {
  check_rows(out, "out");
  check_blocks(blocks, ggml_type, out.size(1));
  TORCH_CHECK(out.size(0) == blocks.size(0) && (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out must be float32 or bfloat16 [rows of blocks, k]");
  const cpu_ops::DequantizeArgs args{dtype_of(out), static_cast<int32_t>(ggml_type), blocks.data_ptr<uint8_t>(),
                                     out.data_ptr(), out.size(1)};
  run_tasks(table().dequantize_rows, args, blocks.size(0), row_grain(out.size(1)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported_forms", &supported_forms);
  m.def("load_form", &load_form);
  m.def("use_form", &use_form);
  m.def("active_form", &active_form);
  m.def("is_parallel", &is_parallel);
  m.def("source_digest", &source_digest);
  m.def("constants", &constants);
  m.def("has_vector_attention", &has_vector_attention);
  m.def("linear_kernels", &linear_kernels);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("rotary_store_kv", &rotary_store_kv);
  m.def("paged_attention", &paged_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start"), py::arg("seqs"), py::arg("scale"),
        py::arg("out"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("max_logsumexp", &max_logsumexp);
  m.def("lora_segments", &lora_segments);
  m.def("f32_linear", &f32_linear, py::arg("out"), py::arg("x"), py::arg("packed"),
        py::arg("fetch_pools") = std::vector<torch::Tensor>{}, py::arg("fetch_pages") = std::vector<torch::Tensor>{});
  m.def("bf16_linear", &bf16_linear, py::arg("out"), py::arg("x"), py::arg("packed"),
        py::arg("fetch_pools") = std::vector<torch::Tensor>{}, py::arg("fetch_pages") = std::vector<torch::Tensor>{});
  m.def("amx_linear", &amx_linear, py::arg("out"), py::arg("x"), py::arg("packed"),
        py::arg("fetch_pools") = std::vector<torch::Tensor>{}, py::arg("fetch_pages") = std::vector<torch::Tensor>{});
  m.def("peak_flops", &peak_flops);
  m.def("peak_read", &peak_read);
  m.def("quantized_linear", &quantized_linear);
  m.def("dequantize_rows", &dequantize_rows);
  m.def("quantized_linear_widened", &quantized_linear_widened);
  m.def("quantized_int8_dot", &quantized_int8_dot);
  m.def("quantized_linear_amx", &quantized_linear_amx);
  m.def("has_quantized_amx", &has_quantized_amx);
  m.def("use_vnni", &use_vnni);
}
