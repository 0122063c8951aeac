// One call of the MTP / EAGLE head's inference forward on the CPU (overlap/models/heads.py,
// MTPHead.forward and compute_logits): the same kernels in the same order on the same
// tensors, so the same bits, in one C++ call instead of ~25 Python dispatches.
//
// Why: an EAGLE step at batch 1 makes three head calls of 1-3 rows (its catch-up and two
// drafting levels) on the stream's worker thread, beside the main thread's Python planning
// the next step. In Python each op of a call re-took the GIL from the main thread and ran
// its dispatch cold: a call that takes 0.21 ms warm and alone took 0.3-0.8 ms in the step
// (docs/mtp_eagle.md, "Session 33"). Here the whole call runs with the GIL released.
#include <torch/extension.h>
#include <cmath>

#include "head_step.h"
#include "kernels.h"

namespace {

bool given(const torch::Tensor& t) { return t.defined() && t.numel() > 0; }

}  // namespace

std::vector<torch::Tensor> HeadStep::forward(torch::Tensor ids, torch::Tensor hidden, torch::Tensor positions,
                                             torch::Tensor k_all, torch::Tensor v_all,
                                             torch::Tensor pairs_all, torch::Tensor slots, torch::Tensor q_start,
                                             torch::Tensor q_len, torch::Tensor kv_len, torch::Tensor page_table,
                                             int64_t page_size, torch::Tensor tree, c10::optional<torch::Tensor> rows) const {
  TORCH_CHECK(hidden.scalar_type() == torch::kBFloat16 && hidden.dim() == 2, "head_step: bf16 hidden [T, H]");
  const int64_t t = ids.size(0);
  // 1. the input: the token's embedding and the hidden state it pairs with, fused to one vector.
  auto e = embed.index_select(0, ids);
  auto h = hidden;
  if (given(norm_embed)) {
    e = rms_norm(e, norm_embed, eps);
    h = rms_norm(h, norm_hidden, eps);
  }
  auto x = fuse(torch::cat({e, h}, -1));
  // 2. the decoder layer (its attention and SwiGLU MLP) over the head's one-layer caches.
  const KvCaches caches{k_all, v_all, pairs_all};
  const AttentionPlan plan{slots, q_start, q_len, kv_len, page_table, tree, page_size};
  x = layer.forward(x, cos.index_select(0, positions), sin.index_select(0, positions), caches, 0, plan);
  // 3. the head's final norm: g, the vector the lm_head reads.
  auto g = given(norm_final) ? rms_norm(x, norm_final, eps) : x;
  if (!rows.has_value()) return {g};
  // 4. logits at the rows asked for (f32; -inf outside a trimmed draft vocabulary).
  auto logits = lm_head(g.index_select(0, *rows), true);
  if (given(vocab_ids)) logits = spread_columns(logits, vocab_ids, vocab);
  return {g, logits};
}

std::vector<torch::Tensor> HeadStep::forward_seqs(torch::Tensor ids, const std::vector<torch::Tensor>& hidden_parts,
                                                  const std::vector<int64_t>& positions, torch::Tensor k_all,
                                                  torch::Tensor v_all, torch::Tensor pairs_all,
                                                  const std::vector<int64_t>& q_lens, const std::vector<int64_t>& kv_lens,
                                                  const std::vector<std::vector<int64_t>>& page_tables,
                                                  const std::vector<c10::optional<torch::Tensor>>& tree_masks,
                                                  int64_t page_size, const std::vector<int64_t>& rows) const {
  const int64_t b = int64_t(q_lens.size());
  TORCH_CHECK(b > 0 && int64_t(kv_lens.size()) == b && int64_t(page_tables.size()) == b &&
                  int64_t(tree_masks.size()) == b, "head_step: one q_len, kv_len, page table and mask per sequence");
  // 1. the attention plan (CpuBackend.plan): each new row's slot, each sequence's first row,
  // its lengths and its page table (padded with page 0, never read).
  int64_t width = 1, total = 0, widest = 0;
  bool any_tree = false;
  for (int64_t s = 0; s < b; ++s) {
    width = std::max<int64_t>(width, int64_t(page_tables[s].size()));
    widest = std::max(widest, q_lens[s]);
    total += q_lens[s];
    any_tree = any_tree || tree_masks[s].has_value();
  }
  TORCH_CHECK(int64_t(positions.size()) == total && ids.size(0) == total, "head_step: one position and id per row");
  auto slots = torch::empty({total}, torch::kInt64);
  auto q_start = torch::empty({b}, torch::kInt32), q_len = torch::empty({b}, torch::kInt32);
  auto kv_len = torch::empty({b}, torch::kInt32), table = torch::zeros({b, width}, torch::kInt32);
  int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t s = 0, row = 0; s < b; ++s) {
    const auto& pages = page_tables[s];
    q_start.data_ptr<int32_t>()[s] = int32_t(row);
    q_len.data_ptr<int32_t>()[s] = int32_t(q_lens[s]);
    kv_len.data_ptr<int32_t>()[s] = int32_t(kv_lens[s]);
    std::copy(pages.begin(), pages.end(), table.data_ptr<int32_t>() + s * width);
    for (int64_t p = kv_lens[s] - q_lens[s]; p < kv_lens[s]; ++p) {
      TORCH_CHECK(p >= 0 && p / page_size < int64_t(pages.size()), "head_step: a row past the sequence's pages");
      slot[row++] = pages[p / page_size] * page_size + p % page_size;
    }
  }
  // 2. the rows' view of their own sequence's new rows, where any sequence has a tree (the
  // others causal); a single sequence's mask is the table itself.
  torch::Tensor tree = torch::empty({0}, torch::kBool);
  if (any_tree && b == 1) {
    tree = tree_masks[0]->to(torch::kBool).contiguous();
  } else if (any_tree) {
    tree = torch::zeros({total, widest}, torch::kBool);
    for (int64_t s = 0, row = 0; s < b; ++s) {
      const int64_t q = q_lens[s];
      auto mask = tree_masks[s].has_value() ? tree_masks[s]->to(torch::kBool)
                                            : torch::ones({q, q}, torch::kBool).tril();
      tree.narrow(0, row, q).narrow(1, 0, q).copy_(mask);
      row += q;
    }
  }
  // 3. the forward, g and the logits at the rows asked for.
  std::vector<torch::Tensor> parts;
  for (const auto& h : hidden_parts) parts.push_back(h.dim() == 1 ? h.unsqueeze(0) : h);
  const auto hidden = parts.size() == 1 ? parts[0] : torch::cat(parts);
  const auto picked = long_tensor(rows);
  auto out = forward(ids, hidden, long_tensor(positions), k_all, v_all, pairs_all, slots, q_start, q_len,
                     kv_len, table, page_size, tree, picked);
  return {out[0].index_select(0, picked), out[1]};
}
