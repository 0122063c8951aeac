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
#include "cpu_empty.h"
#include <cmath>
#include <unordered_map>

#include "head_step.h"
#include "kernels.h"

namespace {

bool given(const torch::Tensor& t) { return t.defined() && t.numel() > 0; }

// Whether rows [R] i64 are every one of t rows, in order (the tree's expansion asks for all).
bool every_row(const torch::Tensor& rows, int64_t t) {
  if (rows.numel() != t || rows.scalar_type() != torch::kLong || !rows.is_contiguous()) return false;
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    if (r[i] != i) return false;
  return true;
}

}  // namespace

std::vector<torch::Tensor> HeadStep::forward(torch::Tensor ids, torch::Tensor hidden, torch::Tensor positions,
                                             torch::Tensor k_all, torch::Tensor v_all,
                                             torch::Tensor pairs_all, torch::Tensor slots, torch::Tensor q_start,
                                             torch::Tensor q_len, torch::Tensor kv_len, torch::Tensor page_table,
                                             int64_t page_size, torch::Tensor tree, c10::optional<torch::Tensor> rows,
                                             bool spread) const {
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
  // (g itself where every row is asked for in order: no gathered copy)
  auto logits = lm_head(every_row(*rows, t) ? g : g.index_select(0, *rows), true);
  if (given(vocab_ids) && spread) logits = spread_columns(logits, vocab_ids, vocab);
  return {g, logits};
}

std::vector<torch::Tensor> HeadStep::forward_seqs(torch::Tensor ids, const std::vector<torch::Tensor>& hidden_parts,
                                                  const std::vector<int64_t>& positions, torch::Tensor k_all,
                                                  torch::Tensor v_all, torch::Tensor pairs_all,
                                                  const std::vector<int64_t>& q_lens, const std::vector<int64_t>& kv_lens,
                                                  const std::vector<std::vector<int64_t>>& page_tables,
                                                  const std::vector<c10::optional<torch::Tensor>>& tree_masks,
                                                  int64_t page_size, const std::vector<int64_t>& rows,
                                                  bool spread) const {
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
  auto slots = cpu_empty({total}, torch::kInt64);
  auto q_start = cpu_empty({b}, torch::kInt32), q_len = cpu_empty({b}, torch::kInt32);
  auto kv_len = cpu_empty({b}, torch::kInt32), table = cpu_empty({b, width}, torch::kInt32);
  std::fill_n(table.data_ptr<int32_t>(), b * width, 0);
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
                     kv_len, table, page_size, tree, picked, spread);
  return {every_row(picked, total) ? out[0] : out[0].index_select(0, picked), out[1]};
}

torch::Tensor HeadStep::top_tokens(const torch::Tensor& logits, int64_t k, bool trimmed) const {
  if (!given(vocab_ids) || vocab_ids.numel() < k)
    return std::get<1>(logits.topk(std::min(k, logits.size(-1))));
  // the ranks' columns back to token ids (vocab_ids[ranked], without torch's indexing)
  const auto ranked = std::get<1>((trimmed ? logits : logits.index_select(1, vocab_ids)).topk(k)).contiguous();
  auto out = cpu_empty(ranked.sizes(), torch::kInt64);
  const int64_t *column = ranked.data_ptr<int64_t>(), *id = vocab_ids.data_ptr<int64_t>();
  int64_t* token = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < ranked.numel(); ++i) token[i] = id[column[i]];
  return out;
}

torch::Tensor HeadStep::expand_tree(const TreePlan& plan, torch::Tensor root_logits, torch::Tensor root_hidden,
                                    const std::vector<int64_t>& start_pos,
                                    const std::vector<std::vector<int64_t>>& page_tables, torch::Tensor k_all,
                                    torch::Tensor v_all, torch::Tensor pairs_all, int64_t page_size) const {
  const int64_t b = root_logits.size(0);
  TORCH_CHECK(int64_t(start_pos.size()) == b && int64_t(page_tables.size()) == b,
              "expand_tree: one root position and page table per sequence");
  auto tokens = torch::zeros({b, plan.num_nodes + 1}, torch::kInt64);  // column 0: the root
  const int64_t width = plan.num_nodes + 1;
  int64_t* tok = tokens.data_ptr<int64_t>();
  // The nodes' logits stay over the trimmed vocabulary's columns where top_tokens reads only
  // those (not where it has fewer than k: it then ranks the whole vocabulary, -inf and all).
  const bool trimmed = given(vocab_ids) && vocab_ids.numel() >= plan.top_k;
  // Per node: the head output its children are ranked from (the root's: the carried one).
  std::unordered_map<int64_t, torch::Tensor> node_logits{{0, root_logits}}, node_hidden{{0, root_hidden}};
  for (const auto& level : plan.levels) {
    // 1. this level's nodes get their tokens from their parents' top-ranked tokens
    for (size_t p = 0; p < level.parents.size(); ++p) {
      // (the root's logits are the carried ones, over the whole vocabulary; the nodes' are
      // this call's, over the trimmed one's columns where there is one)
      const int64_t parent = level.parents[p];
      const auto best = top_tokens(node_logits.at(parent), plan.top_k, trimmed && parent != 0).contiguous();
      // tokens[:, children] = best[:, ranks], written in place
      const auto& children = level.children[p];
      const auto& ranks = level.ranks[p];
      const int64_t *child = children.data_ptr<int64_t>(), *rank = ranks.data_ptr<int64_t>();
      const int64_t* ranked = best.data_ptr<int64_t>();
      const int64_t k = best.size(1);
      for (int64_t c = 0; c < children.numel(); ++c) {
        TORCH_CHECK(child[c] >= 0 && child[c] < width && rank[c] >= 0 && rank[c] < k,
                    "expand_tree: a child or rank outside the tree");
        for (int64_t s = 0; s < b; ++s) tok[s * width + child[c]] = ranked[s * k + rank[c]];
      }
    }
    if (level.rows.empty()) break;
    // 2. the head over every internal node so far (ancestors visible), for the next level;
    // the root sits at position n, a row of depth d drafts from position n - 1 + d.
    const int64_t q = int64_t(level.rows.size());
    // the rows' tokens (tokens[:, rows], sequence-major) and their parents' head hidden states
    auto ids = cpu_empty({b * q}, torch::kInt64);
    int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t s = 0; s < b; ++s)
      for (int64_t j = 0; j < q; ++j) id[s * q + j] = tok[s * width + level.rows[j]];
    std::vector<torch::Tensor> parents;
    for (auto r : level.row_parents) parents.push_back(node_hidden.at(r));
    // one sequence: its rows' parents are the parts forward_seqs concatenates; several: interleaved
    auto hidden = b == 1 ? parents : std::vector<torch::Tensor>{torch::stack(parents, 1).reshape({b * q, -1})};
    std::vector<int64_t> positions, q_lens(b, q), kv_lens, rows(b * q);
    for (int64_t s = 0; s < b; ++s) {
      for (auto offset : level.depth_offsets) positions.push_back(start_pos[s] + offset);
      kv_lens.push_back(start_pos[s] + q);
    }
    for (int64_t r = 0; r < b * q; ++r) rows[r] = r;
    const std::vector<c10::optional<torch::Tensor>> masks(b, level.mask);
    auto out = forward_seqs(ids, hidden, positions, k_all, v_all, pairs_all, q_lens, kv_lens, page_tables, masks,
                            page_size, rows, /*spread=*/!trimmed);
    auto g = out[0].view({b, q, -1}), logits = out[1].view({b, q, -1});
    for (int64_t j = 0; j < q; ++j) {
      node_logits[level.rows[j]] = logits.select(1, j);
      node_hidden[level.rows[j]] = g.select(1, j);
    }
  }
  return tokens.narrow(1, 1, plan.num_nodes);
}
