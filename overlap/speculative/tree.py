"""Draft trees: their shapes and their lossless verification.

Terms as in rejection.py (draft, accepted, recovered, bonus), extended to trees as in
SpecInfer (Miao et al. 2024) and EAGLE (Li et al. 2024):
- a tree's root is the sequence's last known token x_n; node i (1..N) is a draft token at
  depth d_i (position n + d_i) whose parent is node parents[i] (0 = the root). Children of a
  node are ordered (the draft's rank of their token); nodes are numbered parents first.
- verification walks down from the root. At a node with target distribution p it tries the
  children in order: child c (token t) is accepted with probability p_res(t), where p_res
  starts as p and, after each rejected child, loses that child's token and is renormalized
  (the recursive rejection scheme for deterministic, one-hot drafts: each try is a draw from
  p conditioned on not being the tokens already refused, so a duplicate of a refused token is
  refused surely). An accepted child becomes the current node; when every child is refused
  the recovered token is drawn from p_res; a path that reaches a leaf gets a bonus token
  from the leaf's p. Greedy requests have one-hot p: the child equal to the argmax is taken.
The emitted tokens (the accepted path, then the recovered or bonus token) follow the target
distribution exactly, whatever the tree: the draft only decides which candidates are tried.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overlap.kernels import tree_walk_greedy
from overlap.sampling import NOISE_SAMPLE, NOISE_TREE, race, uniform_noise


@dataclass(frozen=True)
class TreeShape:
    """A fixed tree: node i+1 is `paths[i]`, the ranks of the top-K choices from the root
    down (Medusa/EAGLE "choices"). [[0], [1], [0, 0]]: the best two first tokens, and the
    best continuation of the first."""

    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def default(cls, depth: int, topk: int, tokens: int) -> "TreeShape":
        """The `tokens` paths of length <= depth with ranks < topk that a draft with a steeply
        falling rank distribution most likely accepts: ordered by the sum of their ranks
        (rank 0 everywhere first), shorter first on ties."""
        paths: list[tuple[int, ...]] = []
        frontier = [()]
        for _ in range(depth):
            frontier = [p + (r,) for p in frontier for r in range(topk)]
            paths += frontier
        paths.sort(key=lambda p: (sum(p), len(p), p))
        chosen = set(paths[:tokens])
        # Keep it closed under prefixes (every node's parent is in the tree).
        closed = sorted({p[:i] for p in chosen for i in range(1, len(p) + 1)}, key=lambda p: (len(p), p))
        return cls(tuple(closed[:max(tokens, 1)]))

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    def parents(self) -> list[int]:
        """parents[i] for node i+1 (0 = root), nodes numbered 1..N in `paths` order."""
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        return [index.get(p[:-1], 0) for p in self.paths]

    def sibling_order(self) -> list[int]:
        """Each node's index among its siblings, by rank: the order verification tries them."""
        out = []
        for p in self.paths:
            siblings = sorted(q[-1] for q in self.paths if q[:-1] == p[:-1])
            out.append(siblings.index(p[-1]))
        return out

    def depths(self) -> list[int]:
        return [len(p) for p in self.paths]

    def ranks(self) -> list[int]:
        return [p[-1] for p in self.paths]

    def max_children(self) -> int:
        counts: dict[tuple[int, ...], int] = {}
        for p in self.paths:
            counts[p[:-1]] = counts.get(p[:-1], 0) + 1
        return max(counts.values())


def top_path_accepted(top_nodes: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor,
                      nodes: torch.Tensor | None = None, target_best: torch.Tensor | None = None) -> torch.Tensor:
    """How many drafts a chain along each tree's top path would have accepted: [S] i64, -1
    where the tree has no top path (an EAGLE-2 tree grown on the host, a row without drafts:
    nothing to report). top_nodes [S, D] i64: the path's node ids by depth (0 past its end).
    Greedy (nodes [S, N] and target_best [S, N+1] given): the leading depths whose node holds
    the target's choice after its parent, exactly what the chain's verification accepts,
    whichever equal child the walk took. Sampled: the leading depths where the accepted path
    (path [S, D], num_accepted [S]) went through the top path's node."""
    depth = top_nodes.shape[1]
    valid = top_nodes > 0
    if target_best is not None:
        parent_rows = torch.cat([torch.zeros_like(top_nodes[:, :1]), top_nodes[:, :-1]], 1)
        drafted = nodes.gather(1, (top_nodes - 1).clamp(min=0))
        hit = valid & (drafted == target_best.gather(1, parent_rows))
    else:
        kept = torch.arange(depth, device=path.device)[None, :] < num_accepted[:, None]
        hit = valid & kept & (path[:, :depth] == top_nodes)
    return torch.where(valid[:, 0], hit.long().cumprod(1).sum(1), -1)


def children_table(parents: torch.Tensor, order: torch.Tensor, max_children: int) -> torch.Tensor:
    """parents, order [B, N] i64 (order: index among siblings, in the order they are tried)
    → children [B, N+1, C] i64: node ids (1..N) of each node's children, 0 where none (the
    root is row 0)."""
    b, n = parents.shape
    table = torch.zeros(b, (n + 1) * max_children, dtype=torch.long, device=parents.device)
    node = torch.arange(1, n + 1, device=parents.device).expand(b, n)
    table.scatter_(1, parents * max_children + order, node)
    return table.view(b, n + 1, max_children)


def _walk_start(tokens: torch.Tensor, parents: torch.Tensor, order: torch.Tensor, depth: int, max_children: int):
    """A tree walk's starting state, B walks at their roots: (rows [B], children [B, N+1, C],
    node tokens [B, N+1] (root = 0), current node [B], accepted count [B], path [B, D])."""
    b, dev = tokens.shape[0], tokens.device
    children = children_table(parents, order, max_children)
    node_tokens = torch.cat([tokens.new_zeros(b, 1), tokens], dim=1)
    zeros = torch.zeros(b, dtype=torch.long, device=dev)
    return (torch.arange(b, device=dev), children, node_tokens, zeros, zeros.clone(),
            torch.zeros(b, depth, dtype=torch.long, device=dev))


def verify_tree(
    target_probs: torch.Tensor,  # [B, N+1, V] f32: p after the root (row 0) and after each node
    tokens: torch.Tensor,  # [B, N] i64 node tokens
    parents: torch.Tensor,  # [B, N] i64 (0 = root)
    order: torch.Tensor,  # [B, N] i64 index among siblings (the order children are tried in)
    depth: int,
    max_children: int,
    seed: torch.Tensor,  # [B] i64
    first_position: torch.Tensor,  # [B] i64: position of depth-1 nodes
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ (tokens [B, D+1] i64: the accepted path then the recovered/bonus token, padding after;
    num_accepted [B] i64; path [B, D] i64: node ids of the accepted path, 0 past it).
    All on the device; the loops run over depth and children, not over sequences."""
    b = tokens.shape[0]
    rows, children, node_tokens, current, num_accepted, path = _walk_start(tokens, parents, order, depth,
                                                                         max_children)
    alive = torch.ones(b, dtype=torch.bool, device=tokens.device)
    p_res = target_probs[:, 0]  # [B, V]
    for d in range(depth):
        u = uniform_noise(seed, first_position + d, NOISE_TREE, max_children)  # [B, C]
        took = torch.zeros(b, dtype=torch.bool, device=tokens.device)
        for j in range(max_children):
            child = children[rows, current, j]  # [B]
            tried = alive & ~took & (child > 0)
            tok = node_tokens[rows, child]
            p_tok = p_res[rows, tok]
            accept = tried & (u[:, j] < p_tok)
            refused = tried & ~accept
            # A refused token leaves the residual: p_res <- normalize(p_res without it).
            cut = p_res.scatter(1, tok[:, None], 0.0)
            mass = cut.sum(-1, keepdim=True)
            p_res = torch.where(refused[:, None] & (mass > 0), cut / mass.clamp_min(1e-30), p_res)
            current = torch.where(accept, child, current)
            path[:, d] = torch.where(accept, child, path[:, d])
            took |= accept
        num_accepted += took.long()
        alive &= took
        p_res = torch.where(took[:, None], target_probs[rows, current], p_res)
    extra = race(p_res, seed, first_position + num_accepted, NOISE_SAMPLE)  # recovered or bonus
    out = torch.cat([node_tokens.gather(1, path), tokens.new_zeros(b, 1)], dim=1)
    out = out.scatter(1, num_accepted[:, None], extra[:, None])
    return out, num_accepted, path


def _matching_depths(target_best: torch.Tensor, node_tokens: torch.Tensor, parents: torch.Tensor,
                     children: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, N+1] i64: for each node, how many nodes the longest path down from it takes where
    every node holds its parent's argmax (0: the node itself does not; the root counts as
    matching). target_best [B, N+1], node_tokens [B, N+1], parents [B, N], children
    [B, N+1, C] (0 = none). Built bottom-up: after i rounds the paths of up to i nodes."""
    b, c = children.shape[0], children.shape[2]
    matches = torch.cat([torch.ones_like(parents[:, :1], dtype=torch.bool),
                         node_tokens[:, 1:] == target_best.gather(1, parents)], dim=1).long()  # [B, N+1]
    reach = matches
    for _ in range(depth):
        below = reach.gather(1, children.view(b, -1)).view(b, -1, c)  # [B, N+1, C]
        below = torch.where(children > 0, below, 0).amax(dim=2)
        reach = matches * (1 + below)
    return reach


def verify_tree_greedy(
    target_best: torch.Tensor,  # [B, N+1] i64: the target's argmax after the root (0) and each node
    tokens: torch.Tensor,  # [B, N] i64 node tokens
    parents: torch.Tensor,  # [B, N] i64 (0 = root)
    order: torch.Tensor,  # [B, N] i64 index among siblings
    depth: int,
    max_children: int,
    torch_only: bool = False,  # the torch ops even on the CPU (tests compare them with the kernel)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verify_tree when every request is greedy: p is one-hot at the target's argmax, so a
    child is accepted iff its token is that argmax, a refused child leaves the residual as it
    was, and the extra token is the argmax at the end of the path. No [B, N+1, V]
    probabilities, no noise: an argmax walk over depth.

    Where several children hold the argmax (a lookup branch beside the head's drafts can
    repeat a head token, lookup_branch.py), the walk takes the one whose matching subtree runs
    deepest, the first in sibling order on ties. Every path of matching nodes spells the same
    tokens, the target's greedy continuation, so the choice changes how many are accepted,
    never which: the output is verify_tree's on one-hot p, or longer where verify_tree's first
    match ran shorter."""
    if tokens.device.type == "cpu" and not torch_only:
        # One compiled call, the same outputs (the torch ops below: ~100 calls of a few
        # microseconds each for a depth-8 tree; tests compare the two).
        return tree_walk_greedy(target_best, tokens, parents, order, depth, max_children)
    b = tokens.shape[0]
    rows, children, node_tokens, current, num_accepted, path = _walk_start(tokens, parents, order, depth,
                                                                         max_children)
    reach = _matching_depths(target_best, node_tokens, parents, children, depth)  # [B, N+1]
    for d in range(depth):
        # A walk that stopped stays stopped: its node and the argmax after it do not change.
        kids = children[rows, current]  # [B, C], 0 = no child
        runs = torch.where(kids > 0, reach.gather(1, kids), 0)  # [B, C]: 0 = not the argmax
        took = (runs > 0).any(dim=1)
        child = kids.gather(1, runs.argmax(dim=1, keepdim=True))[:, 0]  # deepest, first on ties
        current = torch.where(took, child, current)
        path[:, d] = torch.where(took, child, path[:, d])
        num_accepted += took.long()
    extra = target_best.gather(1, current[:, None])  # recovered or bonus: the argmax
    out = torch.cat([node_tokens.gather(1, path), tokens.new_zeros(b, 1)], dim=1)
    return out.scatter(1, num_accepted[:, None], extra), num_accepted, path
