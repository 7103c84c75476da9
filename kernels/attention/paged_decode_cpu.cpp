#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include <algorithm>

// CPU decode attention read straight from the paged cache: one query token per sequence, keys and
// values walked through the block table in place, so nothing is gathered or padded.
// Semantics (kernels.reference.paged_attention for q_len == 1): for each sequence b and head h,
//   out[rows[b], h] = softmax(q[rows[b], h] . K[b, :, h / group] * scale) @ V[b, :, h / group]
// q [T, H, D]; caches [num_blocks, block_size, Hkv, D] (contiguous); block_tables [B, max_blocks]
// int32; seq_lens [B] int32 (context length, new token included); rows [B] int64; out [T, H, D].
// Accumulation is in fp32 whatever the input dtype.
template <typename scalar_t>
static void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                          const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                          const torch::Tensor& rows, double scale, torch::Tensor& out) {
  const int64_t num_seqs = rows.size(0);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
  const int64_t q_row_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t out_row_stride = out.stride(0), out_head_stride = out.stride(1);
  const int64_t block_stride = k_cache.stride(0), token_stride = k_cache.stride(1), kv_head_stride = k_cache.stride(2);
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, query(group * head_dim), acc(group * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t ctx = lens[seq], row = row_ptr[seq];
      scores.assign(group * ctx, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qh = q_ptr + row * q_row_stride + (kv_head * group + g) * q_head_stride;
        for (int64_t d = 0; d < head_dim; ++d) query[g * head_dim + d] = static_cast<float>(qh[d]) * scale;
      }
      for (int64_t pos = 0; pos < ctx; ++pos) {
        const int64_t block = tables[seq * max_blocks + pos / block_size];
        const scalar_t* kp = k_ptr + block * block_stride + (pos % block_size) * token_stride + kv_head * kv_head_stride;
        for (int64_t g = 0; g < group; ++g) {
          float dot = 0.f;
          const float* qg = query.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(kp[d]);
          scores[g * ctx + pos] = dot;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> inv_sum(group);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * ctx;
        const float m = *std::max_element(s, s + ctx);
        float total = 0.f;
        for (int64_t pos = 0; pos < ctx; ++pos) { s[pos] = std::exp(s[pos] - m); total += s[pos]; }
        inv_sum[g] = 1.f / total;
      }
      for (int64_t pos = 0; pos < ctx; ++pos) {
        const int64_t block = tables[seq * max_blocks + pos / block_size];
        const scalar_t* vp = v_ptr + block * block_stride + (pos % block_size) * token_stride + kv_head * kv_head_stride;
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * ctx + pos];
          float* a = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += w * static_cast<float>(vp[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* oh = out_ptr + row * out_row_stride + (kv_head * group + g) * out_head_stride;
        for (int64_t d = 0; d < head_dim; ++d) oh[d] = static_cast<scalar_t>(acc[g * head_dim + d] * inv_sum[g]);
      }
    }
  });
}

void paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                  torch::Tensor seq_lens, torch::Tensor rows, double scale, torch::Tensor out) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q, k_cache, v_cache, block_tables, seq_lens, rows, scale, out);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
