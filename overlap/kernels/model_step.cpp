// A Llama decoder's inference forward on the CPU in one C++ call: every op of
// LlamaModel.forward (overlap/models/llama.py) through the same kernels in the same order on
// the same tensors, so the same bits, with the GIL released throughout.
//
// Why: a target pass in Python dispatches ~13 ops a layer, 400 for the 30 layers of
// SmolLM2-135M, each a Python call that returns to the interpreter between two kernel calls
// and, on the stream's worker thread, takes the GIL back from the main thread planning the
// next step. At batch 1 that was ~1.5 ms of a ~8.6 ms pass beside the kernels' own time
// (runs/prof/fwd_split.py: kernels 7.1 ms, the pass 8.6 ms; docs/fast_steps.md).
#include <torch/extension.h>
#include "cpu_empty.h"
#include <algorithm>
#include <cmath>

#include "kernels.h"
#include "model_step.h"

namespace {

bool given(const torch::Tensor& t) { return t.defined() && t.numel() > 0; }

// Columns [first, first + n * head_dim) of a row-major [T, W] tensor as [T, n, head_dim].
torch::Tensor heads_of(const torch::Tensor& rows, int64_t first, int64_t n, int64_t head_dim) {
  TORCH_CHECK(rows.dim() == 2 && rows.stride(1) == 1 && first + n * head_dim <= rows.size(1),
              "model_step: head columns past the row");
  return rows.as_strided({rows.size(0), n, head_dim}, {rows.stride(0), head_dim, 1}, rows.storage_offset() + first);
}

// all[layer] of a contiguous [L, ...] tensor.
torch::Tensor layer_of(const torch::Tensor& all, int64_t layer) {
  TORCH_CHECK(all.is_contiguous() && layer >= 0 && layer < all.size(0), "model_step: a layer outside the caches");
  return all.as_strided(all.sizes().slice(1), all.strides().slice(1), all.storage_offset() + layer * all.stride(0));
}

}  // namespace

torch::Tensor long_tensor(const std::vector<int64_t>& values) {
  auto t = cpu_empty({int64_t(values.size())}, torch::kInt64);
  std::copy(values.begin(), values.end(), t.data_ptr<int64_t>());
  return t;
}

torch::Tensor PackedMatmul::operator()(const torch::Tensor& x, bool out_float) const {
  const c10::optional<torch::Tensor> b = given(bias) ? c10::optional<torch::Tensor>(bias) : c10::nullopt;
  return given(scale) ? linear_int8(x, packed, scale, n, b, out_float) : linear(x, packed, n, b, out_float);
}

torch::Tensor DecoderLayerStep::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                        const KvCaches& caches, int64_t layer, const AttentionPlan& plan) const {
  const int64_t t = x.size(0);
  // 1. attention: project, rotate q and k in place, store the new K/V in their slots, attend.
  auto qkv = qkv_proj(rms_norm(x, input_norm, eps));
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, rot_heads = heads + kv_heads;
  rotary_(qkv, cos, sin, rot_heads, head_dim);
  // The q, k and v heads of the rows and this layer's caches as views made in one step each
  // (narrow / view / select chains were ~16 dispatched ops a layer).
  auto q = heads_of(qkv, 0, heads, head_dim), k = heads_of(qkv, q_size, kv_heads, head_dim);
  auto v = heads_of(qkv, q_size + kv_size, kv_heads, head_dim);
  auto k_cache = layer_of(caches.k, layer), v_cache = layer_of(caches.v, layer);
  store_rows(k_cache, plan.slots, k);
  store_rows(v_cache, plan.slots, v);
  const bool pairs = given(caches.pairs);
  if (pairs) sync_value_pairs(caches.v, caches.pairs, plan.slots, plan.page_size, layer);
  auto attn = paged_attention(q, k_cache, v_cache, plan.q_start, plan.q_len, plan.kv_len,
                              plan.page_table, plan.page_size, plan.tree, 1.0 / std::sqrt(double(head_dim)), false,
                              pairs ? c10::optional<torch::Tensor>(caches.pairs[layer]) : c10::nullopt);
  // (the residual adds in place: add_into rounds as torch's bf16 add, without its dispatch)
  auto h = o_proj(attn.view({t, -1}));
  add_into(h, x);
  // 2. the SwiGLU MLP.
  auto out = down_proj(silu_mul(gate_up_proj(rms_norm(h, post_norm, eps))));
  add_into(out, h);
  return out;
}

std::vector<torch::Tensor> ModelStep::forward(torch::Tensor ids, torch::Tensor positions, torch::Tensor k_all,
                                              torch::Tensor v_all, torch::Tensor pairs_all, torch::Tensor slots,
                                              torch::Tensor q_start, torch::Tensor q_len, torch::Tensor kv_len,
                                              torch::Tensor page_table, int64_t page_size, torch::Tensor tree,
                                              c10::optional<torch::Tensor> rows,
                                              const std::vector<int64_t>& taps) const {
  TORCH_CHECK(k_all.dim() == 4 && k_all.size(0) == int64_t(layers.size()) && v_all.sizes() == k_all.sizes(),
              "model_step: K and V of every layer as [L, slots, Hkv, D]");
  const KvCaches caches{k_all, v_all, pairs_all};
  const AttentionPlan plan{slots, q_start, q_len, kv_len, page_table, tree, page_size};
  // 1. the embeddings and the rotary rows, once for every layer.
  auto x = embed.index_select(0, ids);
  const auto c = cos.index_select(0, positions), s = sin.index_select(0, positions);
  // 2. the layers, keeping the outputs a multi-layer head reads.
  std::vector<torch::Tensor> kept;
  for (int64_t i = 0; i < int64_t(layers.size()); ++i) {
    x = layers[i].forward(x, c, s, caches, i, plan);
    if (std::find(taps.begin(), taps.end(), i) != taps.end()) kept.push_back(x);
  }
  // 3. the final norm; the states returned are the head's features where it asked for some.
  auto hidden = rms_norm(x, norm_final, eps);
  auto states = kept.empty() ? hidden : torch::cat(kept, -1);
  if (!rows.has_value()) return {states};
  // 4. logits (f32) at the rows asked for, from the final hidden.
  return {states, lm_head(hidden.index_select(0, *rows), true)};
}
