// The CPU kernels' entry points, defined in their own files (linear_bf16.cpp, linear_int8.cpp,
// attention.cpp, layer_ops.cpp, tree_walk.cpp): declared once for the files that call them
// (bindings.cpp, model_step.cpp, head_step.cpp, tree_walk.cpp).
#pragma once
#include <torch/extension.h>

torch::Tensor pack_weight(torch::Tensor weight);
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias,
                     bool out_float);
int variant();
void set_fma_pairs(bool on);
bool fma_pairs();
void set_prefetch_l2(bool on);
bool prefetch_l2();
torch::Tensor pack_int8(torch::Tensor q);
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, int64_t n,
                          c10::optional<torch::Tensor> bias, bool out_float);
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor q_start, torch::Tensor q_len, torch::Tensor kv_len,
                              torch::Tensor page_table, int64_t page_size, torch::Tensor tree,
                              double scale, bool reference, c10::optional<torch::Tensor> v_pairs);
void sync_value_pairs(torch::Tensor v_all, torch::Tensor pairs_all, torch::Tensor slots, int64_t page_size,
                      int64_t layer);

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rotary_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t rot_heads, int64_t head_dim);
torch::Tensor argmax_rows(torch::Tensor x);
void add_into(torch::Tensor out, const torch::Tensor& x);
void store_rows(torch::Tensor cache, const torch::Tensor& slots, const torch::Tensor& rows);
torch::Tensor spread_columns(torch::Tensor sub, torch::Tensor ids, int64_t vocab);
std::vector<torch::Tensor> tree_walk_greedy(torch::Tensor target_best, torch::Tensor tokens, torch::Tensor parents,
                                            torch::Tensor order, int64_t depth, int64_t max_children);
std::vector<torch::Tensor> verify_trees_greedy(torch::Tensor logits, torch::Tensor rows_at, torch::Tensor tokens,
                                               torch::Tensor parents, torch::Tensor order, int64_t depth,
                                               int64_t max_children, torch::Tensor top_nodes);
void move_slots(torch::Tensor k_all, torch::Tensor v_all, torch::Tensor pairs_all, const std::vector<int64_t>& src,
                const std::vector<int64_t>& dst, int64_t page_size);
torch::Tensor compact_paths(torch::Tensor accepted, torch::Tensor path, torch::Tensor slots, torch::Tensor starts,
                            torch::Tensor moved_rows, torch::Tensor hidden, torch::Tensor k_all, torch::Tensor v_all,
                            torch::Tensor pairs_all, int64_t page_size);
