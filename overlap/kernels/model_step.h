// A Llama decoder's inference forward on the CPU as one C++ call (model_step.cpp): the
// target's and a draft model's passes (overlap/models/llama.py, LlamaModel.forward) and the
// decoder layer of an MTP / EAGLE head (head_step.cpp). bindings.cpp makes these from Python
// once per model (kernels.model_step, kernels.layer_step).
#pragma once
#include <torch/extension.h>

// The sum of some tensors' version counters (each moves when its tensor changes in place, and
// only grows): a fused call kept on its model is made again when the sum moves (models/fused.py).
// Summed here, not in Python: a target's ~270 tensors took ~0.1 ms a pass there.
struct VersionWatch {
  std::vector<torch::Tensor> tensors;
  int64_t sum() const {
    int64_t total = 0;
    for (const auto& t : tensors) total += int64_t(t._version());
    return total;
  }
};

// A list of int64 as a CPU tensor (the planned call's positions, rows, ids from a list).
torch::Tensor long_tensor(const std::vector<int64_t>& values);

// One matmul of a fused call: a packed bf16 weight (scale empty) or a packed int8 weight and
// its per-row scales (the kernels' `linear` / `linear_int8`), n output columns, an optional bias.
struct PackedMatmul {
  torch::Tensor packed, scale, bias;
  int64_t n = 0;
  torch::Tensor operator()(const torch::Tensor& x, bool out_float = false) const;
};

// A model's KV caches as the fused calls read and write them: K and V of every layer as flat
// slot arrays [L, slots, Hkv, D], and V's key-pair copy [L, pages, Hkv, page_size / 2, D, 2]
// where the pool keeps one (KVPool.slot_arrays), else an empty tensor.
struct KvCaches {
  torch::Tensor k, v, pairs;
};

// The CPU backend's attention plan for one pass (overlap/attention/cpu.py, CpuMetadata):
// each new row's slot, each sequence's first row, new rows, cached + new length, page table,
// and the rows' view of their own sequence's new rows (empty: causal).
struct AttentionPlan {
  torch::Tensor slots, q_start, q_len, kv_len, page_table, tree;
  int64_t page_size = 0;
};

// One decoder layer (llama.py, DecoderLayer.forward): the same kernels in the same order.
struct DecoderLayerStep {
  PackedMatmul qkv_proj, o_proj, gate_up_proj, down_proj;
  torch::Tensor input_norm, post_norm;  // [H] each
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  double eps = 0;

  // x [T, H] bf16 → the layer's output; cos, sin [T, head_dim] at the rows' positions; the
  // layer's K/V are caches.k[layer], caches.v[layer].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const KvCaches& caches, int64_t layer, const AttentionPlan& plan) const;
};

struct ModelStep {
  torch::Tensor embed;                    // [V, H]
  std::vector<DecoderLayerStep> layers;
  torch::Tensor norm_final;               // [H]
  PackedMatmul lm_head;
  torch::Tensor cos, sin;                 // the rotary table [max_position, head_dim]
  double eps = 0;

  // ids, positions [T] i64; caches and plan as above; rows [R] i64 or None; taps: decoder
  // layers whose outputs to return instead of the final hidden (a multi-layer head's
  // features) → {states [T, H] (or [T, len(taps) * H])} or {states, logits [R, V] f32 from
  // the final hidden}.
  std::vector<torch::Tensor> forward(torch::Tensor ids, torch::Tensor positions, torch::Tensor k_all,
                                     torch::Tensor v_all, torch::Tensor pairs_all, torch::Tensor slots,
                                     torch::Tensor q_start, torch::Tensor q_len, torch::Tensor kv_len,
                                     torch::Tensor page_table, int64_t page_size, torch::Tensor tree,
                                     c10::optional<torch::Tensor> rows, const std::vector<int64_t>& taps) const;
};
