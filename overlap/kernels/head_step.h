// The head's weights as head_step.cpp's single-call forward reads them (bindings.cpp makes
// them from Python once per head: overlap/models/heads.py, MTPHead._fused_step).
#pragma once
#include <torch/extension.h>

#include "model_step.h"

// An EAGLE tree's expansion levels (overlap/speculative/eagle.py, _Level), fixed by the
// tree's shape: made once per shape from Python, read by HeadStep::expand_tree every step.
struct TreeLevel {
  std::vector<int64_t> parents;                             // the nodes whose children this level draws
  std::vector<torch::Tensor> children, ranks;               // per parent: its children here [c], their ranks [c]
  std::vector<int64_t> rows;                                // the internal nodes the head runs on next
  torch::Tensor row_index;                                  // [q] i64: rows, as token columns
  std::vector<int64_t> row_parents;                         // each row's parent (whose head hidden it reads)
  c10::optional<torch::Tensor> mask;                        // [q, q] the rows' ancestor mask
  std::vector<int64_t> depth_offsets;                       // each row's depth - 1
};

struct TreePlan {
  std::vector<TreeLevel> levels;
  int64_t num_nodes = 0, top_k = 0;
};

struct HeadStep {
  torch::Tensor embed;                    // [V, H] the target's embedding (shared)
  torch::Tensor norm_embed, norm_hidden;  // [H] each, or empty (norms=False)
  PackedMatmul fuse, lm_head;
  DecoderLayerStep layer;
  torch::Tensor norm_final;               // [H], or empty (norms=False)
  torch::Tensor cos, sin;                 // the rotary table [max_position, head_dim]
  torch::Tensor vocab_ids;                // [N] i64 ascending (a trimmed draft vocabulary), or empty
  int64_t vocab = 0;
  double eps = 0;

  // ids [T] i64, hidden [T, H] bf16, positions [T] i64; the head's one-layer caches
  // (model_step.h, KvCaches: k_all, v_all [1, slots, Hkv, D], pairs_all or empty) and the CPU
  // backend's plan (slots .. tree; an empty tree: causal); rows [R] i64 or None
  // → {g [T, H] bf16} or {g, logits [R, vocab] f32}.
  std::vector<torch::Tensor> forward(torch::Tensor ids, torch::Tensor hidden, torch::Tensor positions,
                                     torch::Tensor k_all, torch::Tensor v_all,
                                     torch::Tensor pairs_all, torch::Tensor slots, torch::Tensor q_start,
                                     torch::Tensor q_len, torch::Tensor kv_len, torch::Tensor page_table,
                                     int64_t page_size, torch::Tensor tree, c10::optional<torch::Tensor> rows,
                                     bool spread = true) const;

  // The same call planned here from the step's lists (what CpuBackend.plan computes from its
  // SeqAttention list, without its Python and its tensors): positions [T]; per sequence its
  // new rows q_lens[b], cached + new kv_lens[b], its page table and its [q, q] tree mask (or
  // None: causal); rows [R] → {g at rows [R, H], logits [R, vocab] f32}. hidden in parts
  // ([n, H] or one row [H]), concatenated here; bindings.cpp also takes the ids as a list.
  std::vector<torch::Tensor> forward_seqs(torch::Tensor ids, const std::vector<torch::Tensor>& hidden,
                                          const std::vector<int64_t>& positions,
                                          torch::Tensor k_all, torch::Tensor v_all,
                                          torch::Tensor pairs_all, const std::vector<int64_t>& q_lens,
                                          const std::vector<int64_t>& kv_lens,
                                          const std::vector<std::vector<int64_t>>& page_tables,
                                          const std::vector<c10::optional<torch::Tensor>>& tree_masks,
                                          int64_t page_size, const std::vector<int64_t>& rows,
                                          bool spread = true) const;

  // EagleProposer.propose_tree in one call: every level's top-ranked tokens from its
  // parents' head outputs (the root's: root_logits [B, V] f32, root_hidden [B, H]), then the
  // head over the level's internal nodes (forward_seqs, the same call the proposer makes) →
  // the node tokens [B, N] i64. Per sequence: its root's position and its page table.
  torch::Tensor expand_tree(const TreePlan& plan, torch::Tensor root_logits, torch::Tensor root_hidden,
                            const std::vector<int64_t>& start_pos,
                            const std::vector<std::vector<int64_t>>& page_tables, torch::Tensor k_all,
                            torch::Tensor v_all, torch::Tensor pairs_all, int64_t page_size) const;

 private:
  // EagleProposer._top_tokens: the k best tokens of each row [B, k], best first (over the
  // trimmed vocabulary's columns where there is one); trimmed: logits holds only those
  // columns (forward's spread = false), the same values index_select would pick.
  torch::Tensor top_tokens(const torch::Tensor& logits, int64_t k, bool trimmed) const;
};
