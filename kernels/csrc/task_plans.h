// How the bindings hand an op's tasks to PyTorch's threads where tasks differ in cost: a range of
// tasks a thread, of about equal cost (the LoRA op's segment pieces, attention's sequences and key chunks),
// and the attention op's tasks themselves. Plain C++ (no PyTorch headers): the bindings pass the
// thread count.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "lora_serve_tuning.h"

namespace cpu_ops {

// Tasks of `width` int64 fields each, regrouped in place so that thread t runs [starts[t], starts[t + 1]):
// the costliest first, each to the thread with the least cost so far (ties: the lower thread), the
// tasks of a thread in their first order. Contiguous ranges in the first order left a thread up to
// half a coarse task (a rank-64 adapter's decode tokens) behind the other. Only the order of disjoint
// outputs changes: every element is the same sum, and the same split for a given thread count.
inline std::vector<int64_t> balance_tasks(std::vector<int64_t>& tasks, int64_t width, const std::vector<double>& costs,
                                          int64_t num_threads) {
  const int64_t n = static_cast<int64_t>(costs.size());
  std::vector<int64_t> by_cost(n), owner(n);
  for (int64_t i = 0; i < n; ++i) by_cost[i] = i;
  std::stable_sort(by_cost.begin(), by_cost.end(), [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  std::vector<double> load(num_threads, 0.0);
  for (int64_t i : by_cost) {
    const int64_t least = std::min_element(load.begin(), load.end()) - load.begin();
    owner[i] = least;
    load[least] += costs[i];
  }
  std::vector<int64_t> grouped, starts(num_threads + 1, 0);
  grouped.reserve(tasks.size());
  for (int64_t t = 0; t < num_threads; ++t) {
    starts[t] = static_cast<int64_t>(grouped.size()) / width;
    for (int64_t i = 0; i < n; ++i)
      if (owner[i] == t) grouped.insert(grouped.end(), tasks.begin() + i * width, tasks.begin() + (i + 1) * width);
  }
  starts[num_threads] = n;
  tasks.swap(grouped);
  return starts;
}

// The attention op's tasks (AttentionArgs::tasks [n][5], splits [m][4]) and each thread's share.
struct AttentionPlan {
  std::vector<int64_t> tasks, splits, starts;
  int64_t num_slots = 0;
};

// One sequence's new tokens, their keys and the first key its first token reads (a window's oldest).
struct SequenceKeys {
  int64_t seq, token, q_len, first, ctx;  // token: the row of its first new token in q and out

  double cost() const {  // keys read, all tokens together (the causal triangle of a prefill chunk)
    return static_cast<double>(q_len) * static_cast<double>(ctx - first) - static_cast<double>(q_len * (q_len - 1)) / 2;
  }
};

// The key chunks of a decode token reading `keys` keys: one while it costs at most `target` keys, else
// the fewest of at least kAttentionMinKeysPerTask keys each that bring each chunk to `target`.
inline int64_t key_chunks(int64_t keys, double target) {
  if (static_cast<double>(keys) <= target) return 1;
  const int64_t most = std::max<int64_t>(1, keys / tuning::kAttentionMinKeysPerTask);
  return std::clamp<int64_t>(static_cast<int64_t>(std::ceil(static_cast<double>(keys) / target)), 1, most);
}

// One task per (sequence, KV head), and on more than one thread a decode token whose keys outweigh
// 1 / kAttentionTasksPerThread of a thread's share split into chunks of its keys (each a task writing
// a slot of partial results, merged by a split), so that one long decode keeps every thread busy.
// On one thread nothing is split: the result is that of one task per (sequence, KV head).
inline AttentionPlan plan_attention(const std::vector<SequenceKeys>& sequences, int64_t num_kv_heads,
                                    int64_t num_threads) {
  double total = 0;
  for (const SequenceKeys& s : sequences) total += s.cost() * static_cast<double>(num_kv_heads);
  const double target = num_threads == 1 ? INFINITY
                                         : total / static_cast<double>(num_threads * tuning::kAttentionTasksPerThread);
  AttentionPlan plan;
  std::vector<double> costs;
  const double task_overhead = tuning::kAttentionTaskOverheadKeys;
  for (const SequenceKeys& s : sequences) {
    const int64_t keys = s.ctx - s.first;
    const int64_t chunks = s.q_len == 1 ? key_chunks(keys, target) : 1;
    for (int64_t head = 0; head < num_kv_heads; ++head) {
      if (chunks == 1) {
        plan.tasks.insert(plan.tasks.end(), {s.seq, head, 0, s.ctx, -1});
        costs.push_back(s.cost() + task_overhead);
        continue;
      }
      plan.splits.insert(plan.splits.end(), {s.token, head, plan.num_slots, chunks});
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t begin = s.first + keys * c / chunks, end = s.first + keys * (c + 1) / chunks;
        plan.tasks.insert(plan.tasks.end(), {s.seq, head, begin, end, plan.num_slots++});
        costs.push_back(static_cast<double>(end - begin) + task_overhead);
      }
    }
  }
  plan.starts = balance_tasks(plan.tasks, 5, costs, num_threads);
  return plan;
}

}  // namespace cpu_ops
