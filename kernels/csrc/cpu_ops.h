// The compiled CPU ops of the kernel library; semantics in kernels/reference.py, one twin each.
#pragma once
#include <torch/extension.h>
#include <vector>

void paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                     torch::Tensor seq_lens, torch::Tensor query_start, torch::Tensor seqs, double scale,
                     torch::Tensor out);
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void add_rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void silu_and_mul(torch::Tensor out, torch::Tensor gate_up);
void rotary_store_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                     torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t num_heads,
                     int64_t num_kv_heads);
void max_logsumexp(torch::Tensor scores, torch::Tensor values, torch::Tensor indices, torch::Tensor log_normaliser);
void lora_segments(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor segments,
                   std::vector<int64_t> slot_ranks, std::vector<int64_t> slice_offsets, std::vector<double> scales);
bool amx_ready();
void amx_linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed);
bool avx512_bf16_ready();
void avx512_bf16_linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed);
