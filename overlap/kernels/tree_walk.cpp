// The greedy tree walk (overlap/speculative/tree.py, verify_tree_greedy) for CPU tensors: the
// same arithmetic as the torch version, one call instead of ~100 tiny aten ops (a walk over a
// depth-8 tree with a lookup branch cost ~0.7 ms a step as torch ops, each a few microseconds
// of dispatch over a handful of integers).
//
// Per row b of the batch, with nodes 1..N (0 = the root):
//   children[p][o] = the node whose parent is p and sibling index o (the last such node when
//     several claim one cell, as torch's scatter_ on the CPU leaves it), 0 = none;
//   matches[n] = node n's token is the target's argmax after its parent (the root matches);
//   reach[n] = the nodes the longest all-matching path down from n takes, found in `depth`
//     rounds of reach[n] = matches[n] * (1 + max over children c of reach[c]);
//   the walk goes `depth` levels from the root: at each, to the child with the largest reach
//     (the first in sibling order on ties), if any child's reach is positive; else it stops.
// Outputs as tree.py's: tokens [B, D+1] (the path's tokens, the argmax after its last node,
// zeros after), num_accepted [B], path [B, D] (node ids, 0 past the walk).
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "model_step.h"

std::vector<torch::Tensor> tree_walk_greedy(torch::Tensor target_best, torch::Tensor tokens, torch::Tensor parents,
                                            torch::Tensor order, int64_t depth, int64_t max_children) {
  for (const auto& t : {target_best, tokens, parents, order})
    TORCH_CHECK(t.scalar_type() == torch::kLong && t.dim() == 2 && t.device().is_cpu(),
                "tree_walk_greedy: i64 [B, ...] CPU tensors");
  const int64_t b = tokens.size(0), n = tokens.size(1), c = max_children;
  TORCH_CHECK(target_best.size(0) == b && target_best.size(1) == n + 1 && parents.sizes() == tokens.sizes() &&
                  order.sizes() == tokens.sizes() && depth >= 0 && c >= 1,
              "tree_walk_greedy: target_best [B, N+1], tokens/parents/order [B, N], depth >= 0, max_children >= 1");
  target_best = target_best.contiguous();
  tokens = tokens.contiguous();
  parents = parents.contiguous();
  order = order.contiguous();
  const int64_t* best = target_best.data_ptr<int64_t>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* par = parents.data_ptr<int64_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  for (int64_t i = 0; i < b * n; ++i)
    TORCH_CHECK(par[i] >= 0 && par[i] <= n && ord[i] >= 0 && ord[i] < c,
                "tree_walk_greedy: parents in [0, N] and sibling order in [0, max_children)");

  auto out = torch::zeros({b, depth + 1}, tokens.options());
  auto accepted = torch::zeros({b}, tokens.options());
  auto path = torch::zeros({b, depth}, tokens.options());
  int64_t* out_p = out.data_ptr<int64_t>();
  int64_t* acc_p = accepted.data_ptr<int64_t>();
  int64_t* path_p = path.data_ptr<int64_t>();

  std::vector<int64_t> children((n + 1) * c), node_tokens(n + 1), matches(n + 1), reach(n + 1), next(n + 1);
  for (int64_t row = 0; row < b; ++row) {
    const int64_t* rb = best + row * (n + 1);
    const int64_t* rt = tok + row * n;
    const int64_t* rp = par + row * n;
    const int64_t* ro = ord + row * n;
    // 1. the children table and each node's match
    std::fill(children.begin(), children.end(), 0);
    node_tokens[0] = 0;
    matches[0] = 1;
    for (int64_t i = 0; i < n; ++i) {
      children[rp[i] * c + ro[i]] = i + 1;
      node_tokens[i + 1] = rt[i];
    }
    for (int64_t i = 1; i <= n; ++i) matches[i] = node_tokens[i] == rb[rp[i - 1]];
    // 2. the deepest all-matching path below each node, `depth` rounds
    reach = matches;
    for (int64_t round = 0; round < depth; ++round) {
      for (int64_t v = 0; v <= n; ++v) {
        int64_t below = 0;
        for (int64_t j = 0; j < c; ++j) {
          const int64_t kid = children[v * c + j];
          if (kid > 0) below = std::max(below, reach[kid]);
        }
        next[v] = matches[v] * (1 + below);
      }
      std::swap(reach, next);
    }
    // 3. the walk: the deepest matching child, the first on ties
    int64_t current = 0, a = 0;
    for (int64_t d = 0; d < depth; ++d) {
      int64_t pick = 0, pick_reach = 0;
      for (int64_t j = 0; j < c; ++j) {
        const int64_t kid = children[current * c + j];
        const int64_t r = kid > 0 ? reach[kid] : 0;
        if (r > pick_reach) pick = kid, pick_reach = r;
      }
      if (pick_reach == 0) break;  // a walk that stopped stays stopped
      current = pick;
      path_p[row * depth + d] = pick;
      out_p[row * (depth + 1) + d] = node_tokens[pick];
      ++a;
    }
    acc_p[row] = a;
    out_p[row * (depth + 1) + a] = rb[current];  // recovered or bonus: the argmax
  }
  return {out, accepted, path};
}

// The greedy verification of a step's trees (overlap/executor.py, _verify_trees) for CPU
// tensors in one call: the target's argmax at each verified row, the walk above, and how many
// drafts each tree's top path alone would have accepted (speculative/tree.py,
// top_path_accepted). The same outputs as those torch ops (~20 calls of a few microseconds
// over a handful of integers). logits [R, V] f32; rows_at [R] i64: each row's cell in the
// [B, N+1] table of argmaxes (cells no row fills stay 0); top_nodes [B, D] i64 (0 past the
// path's end) → {tokens, num_accepted, path, top_accepted [B] (-1 where no top path)}.
std::vector<torch::Tensor> verify_trees_greedy(torch::Tensor logits, torch::Tensor rows_at, torch::Tensor tokens,
                                               torch::Tensor parents, torch::Tensor order, int64_t depth,
                                               int64_t max_children, torch::Tensor top_nodes) {
  const int64_t b = tokens.size(0), n = tokens.size(1);
  TORCH_CHECK(rows_at.scalar_type() == torch::kLong && rows_at.numel() == logits.size(0) &&
                  top_nodes.scalar_type() == torch::kLong && top_nodes.dim() == 2 && top_nodes.size(0) == b,
              "verify_trees_greedy: one cell per logits row, top_nodes [B, D] i64");
  // 1. the argmax after the root and each node, [B, N+1]
  auto best = torch::zeros({b * (n + 1)}, tokens.options());
  best.index_put_({rows_at}, argmax_rows(logits));
  best = best.view({b, n + 1});
  // 2. the walk
  auto walked = tree_walk_greedy(best, tokens, parents, order, depth, max_children);
  // 3. the top path's leading depths whose node holds the target's choice after its parent
  top_nodes = top_nodes.contiguous();
  const int64_t top_depth = top_nodes.size(1);
  const int64_t* top = top_nodes.data_ptr<int64_t>();
  const int64_t* best_p = best.data_ptr<int64_t>();
  const int64_t* tok = tokens.contiguous().data_ptr<int64_t>();
  auto top_accepted = torch::empty({b}, tokens.options());
  int64_t* top_acc = top_accepted.data_ptr<int64_t>();
  for (int64_t row = 0; row < b; ++row) {
    const int64_t* nodes = top + row * top_depth;
    if (top_depth == 0 || nodes[0] <= 0) {
      top_acc[row] = -1;
      continue;
    }
    int64_t hits = 0;
    for (int64_t d = 0; d < top_depth && nodes[d] > 0 && nodes[d] <= n; ++d) {
      const int64_t parent = d == 0 ? 0 : nodes[d - 1];
      if (tok[row * n + nodes[d] - 1] != best_p[row * (n + 1) + parent]) break;
      ++hits;
    }
    top_acc[row] = hits;
  }
  return {walked[0], walked[1], walked[2], top_accepted};
}

// KV slots moved in every layer (KVPool.copy_slots on the CPU, and compact_paths below): slot
// dst[i] takes what src[i] held, in K and V of every layer ([L, slots, Hkv, D], contiguous,
// any dtype), and V's key-pair copy is re-derived at the destinations where pairs_all is given
// (not empty). Only the slots that change are copied (a tree's accepted nodes are mostly in
// their place already, and the depths not accepted copy onto themselves), by plain row copies
// instead of an index_select / index_copy_ pair over a strided dimension (0.26 -> 0.05 ms a
// step at batch 1). Every source is read before any destination is written: a source may be
// another's destination.
void move_slots(torch::Tensor k_all, torch::Tensor v_all, torch::Tensor pairs_all, const std::vector<int64_t>& src,
                const std::vector<int64_t>& dst, int64_t page_size) {
  TORCH_CHECK(src.size() == dst.size(), "move_slots: one destination per source");
  std::vector<int64_t> from_slot, to_slot;
  for (size_t i = 0; i < src.size(); ++i)
    if (src[i] != dst[i]) from_slot.push_back(src[i]), to_slot.push_back(dst[i]);
  if (from_slot.empty()) return;
  TORCH_CHECK(k_all.is_contiguous() && v_all.is_contiguous() && k_all.dim() == 4 && v_all.sizes() == k_all.sizes(),
              "move_slots: contiguous K and V [L, slots, Hkv, D]");
  const int64_t layers = k_all.size(0), num_slots = k_all.size(1), per_slot = k_all.size(2) * k_all.size(3);
  const int64_t moves = int64_t(from_slot.size()), bytes = per_slot * k_all.element_size();
  for (int64_t i = 0; i < moves; ++i)
    TORCH_CHECK(from_slot[i] >= 0 && from_slot[i] < num_slots && to_slot[i] >= 0 && to_slot[i] < num_slots,
                "move_slots: a slot outside the pool");
  std::vector<char> staged(size_t(layers * moves * bytes));
  for (auto cache : {k_all, v_all}) {
    char* base = static_cast<char*>(cache.data_ptr());
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t i = 0; i < moves; ++i)
        std::memcpy(staged.data() + (l * moves + i) * bytes, base + (l * num_slots + from_slot[i]) * bytes, bytes);
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t i = 0; i < moves; ++i)
        std::memcpy(base + (l * num_slots + to_slot[i]) * bytes, staged.data() + (l * moves + i) * bytes, bytes);
  }
  if (pairs_all.defined() && pairs_all.numel() > 0)
    sync_value_pairs(v_all, pairs_all, long_tensor(to_slot), page_size, -1);
}

// The accepted paths moved into place (executor.py, _verify_trees' compaction): the node at
// depth i of row b's accepted path moves its KV from slots[b, path[b, i]] to slots[b, 1 + i]
// in every layer (k_all, v_all [L, slots, Hkv, D], gathered before any is written, and V's
// pair copy re-derived there where pairs is given), and its hidden state from row
// starts[b] + path[b, i] to moved_rows[b, i]; depths past the accepted ones stay where they
// are. → the moved hidden states (a copy of hidden).
torch::Tensor compact_paths(torch::Tensor accepted, torch::Tensor path, torch::Tensor slots, torch::Tensor starts,
                            torch::Tensor moved_rows, torch::Tensor hidden, torch::Tensor k_all, torch::Tensor v_all,
                            torch::Tensor pairs_all, int64_t page_size) {
  const int64_t b = path.size(0), depth = path.size(1), width = slots.size(1);
  TORCH_CHECK(slots.size(0) == b && width >= depth + 1 && moved_rows.sizes() == path.sizes() &&
                  accepted.numel() == b && starts.numel() == b,
              "compact_paths: path, moved_rows [B, D], slots [B, >= D+1], accepted, starts [B]");
  accepted = accepted.contiguous(), path = path.contiguous(), slots = slots.contiguous();
  starts = starts.contiguous(), moved_rows = moved_rows.contiguous();
  const int64_t *acc = accepted.data_ptr<int64_t>(), *pth = path.data_ptr<int64_t>();
  const int64_t *slot = slots.data_ptr<int64_t>(), *start = starts.data_ptr<int64_t>();
  const int64_t* moved_to = moved_rows.data_ptr<int64_t>();
  std::vector<int64_t> src(b * depth), dst(b * depth);
  auto src_rows = torch::empty({b * depth}, torch::kLong);
  int64_t* from = src_rows.data_ptr<int64_t>();
  for (int64_t row = 0; row < b; ++row)
    for (int64_t d = 0; d < depth; ++d) {
      const int64_t i = row * depth + d;
      const bool kept = d < acc[row];
      TORCH_CHECK(!kept || (pth[i] >= 0 && pth[i] < width), "compact_paths: a path node outside its tree");
      dst[i] = slot[row * width + 1 + d];
      src[i] = kept ? slot[row * width + pth[i]] : dst[i];
      from[i] = kept ? start[row] + pth[i] : moved_to[i];
    }
  // 1. KV (KVPool.copy_slots)
  move_slots(k_all, v_all, pairs_all, src, dst, page_size);
  // 2. the hidden states the drafter's catch-up reads
  auto moved = hidden.clone();
  moved.index_copy_(0, moved_rows.view({-1}), hidden.index_select(0, src_rows));
  return moved;
}
