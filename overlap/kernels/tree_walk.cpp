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
#include <vector>

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
