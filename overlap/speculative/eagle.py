"""EAGLE tree drafting with the MTP head (heads.py), verified in one target pass with a tree
attention mask (tree.py has the shapes and the verifier).

Expansion (a fixed shape, EAGLE/Medusa "choices"): the root's children are the top-ranked
tokens of the carried head distribution; to expand a node the head runs on (its token, its
parent's head hidden state), exactly as the MTP chain does for k > 1, and the node's children
are the top-ranked tokens of that output. The head sees, for each node, the committed rows
plus the node's own ancestors: each expansion level runs the head over every internal node
found so far with a tree mask (a few rows more than strictly needed, no per-node gathers),
the rows at consecutive scratch slots after the sequence's last committed head row.

Positions and slots of a tree of depth D and N nodes over a sequence whose last known token
x_n sits at position n:
  target verify rows  [x_n, node_1 .. node_N] at slots n .. n+N, positions n + depth;
  head expansion rows at slots n .. (internal nodes), positions n - 1 + depth.
After verification the accepted path's target KV moves to slots n+1 .. n+a (tree.py returns
the path; the executor compacts), and the head re-runs over the accepted rows with the
target's hidden states (HeadProposer.catch_up, as for MTP chains), which overwrites its
expansion rows.

Chains beside the trees: a sequence asked for fewer drafts than the tree's nodes (the
controller chose so, or it has no room for the tree near max_tokens or the context end) gets
a chain of that many drafts (at most the depth) along the tree's top-ranked path, the head's
top-1 draft at each level: an MTP chain, verified in the same pass as a one-child-per-node
tree. Its tokens come from the same expansion as the trees (the top path is part of every
tree), so chains and trees of one step share one proposal; a chain is granted only where the
sequence's pages hold the expansion's rows (near max_tokens it may not: it decodes plainly).
A step with chains only is an MTP step: the head expands the top path alone and the target
verifies causal chains (no tree mask, no tree walk): at batch 1 on the Xeon an EAGLE chain
step cost 10-17% more than MTP's with the same drafts before, 5-6% after (docs/controller.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from overlap import kernels
from overlap.attention.base import AttentionBackend, SeqAttention, tree_mask_from_parents
from overlap.batch import BatchPlan, SeqWork
from overlap.device import upload
from overlap.models.heads import MTPHead
from overlap.speculative.base import DraftLayout, DraftRequest, Proposal, TreeLayout, Verified
from overlap.speculative.head_proposer import HeadProposer
from overlap.speculative.tree import TreeShape


class _VerifiedShape(NamedTuple):
    """The nodes one sequence verifies, as TreeLayout and DraftLayout hold them."""

    parents: list[int]
    order: list[int]
    mask: torch.Tensor
    depths: list[int]
    top_path: list[int]  # its nodes on the tree's top path (a chain: all)


class EagleProposer(HeadProposer):
    """A fixed tree shape for every sequence; its tokens are drafted on the device (stage 2)."""

    name = "eagle"

    def __init__(self, head: MTPHead, backend: AttentionBackend, num_pages: int, page_size: int,
                 shape: TreeShape, scratch_page: int | None = None):
        super().__init__(head, backend, num_pages, page_size, scratch_page)
        self.tree = shape
        parents, depths = shape.parents(), shape.depths()
        self.num_nodes, self.depth = shape.size, shape.depth
        # Internal nodes (those with children), parents first: the head runs on them.
        has_children = set(parents)
        self.internal = [i for i in range(1, shape.size + 1) if i in has_children]
        self.node_parents, self.node_depths = parents, depths
        self.sibling_order = shape.sibling_order()
        # Verification mask over [root, nodes]: each row sees the root and its ancestors.
        self.verify_mask = tree_mask_from_parents([-1] + parents)
        # The top-ranked path (ranks 0, 0, ...), depth first: the nodes a chain of c drafts is.
        self.top_path = [i + 1 for i, p in sorted(enumerate(shape.paths), key=lambda x: len(x[1]))
                         if not any(p)]
        # What a sequence granted g drafts verifies: the whole tree (g = its nodes), or a chain
        # of g drafts as a tree (node j's parent is node j - 1; a causal mask).
        self.verified_shapes = {c: _VerifiedShape(list(range(c)), [0] * c, tree_mask_from_parents(list(range(-1, c))),
                                             list(range(1, c + 1)), list(range(1, c + 1)))
                                for c in range(1, len(self.top_path) + 1)}
        self.verified_shapes[self.num_nodes] = _VerifiedShape(parents, self.sibling_order, self.verify_mask, depths,
                                                              self.top_path)
        self._level_plans: dict[frozenset[int] | None, list[_Level]] = {}
        self._tree_plans: dict[frozenset[int] | None, object] = {}  # the same, as kernels.tree_plan
        self.top_k = max(shape.ranks()) + 1  # tokens ranked per expanded node

    def _granted(self, k: int, seq: SeqWork) -> int:
        """Drafts a sequence asked for k gets: the tree (k >= its nodes), a chain of up to the
        top path's length, or none. A chain's tokens come from the tree's expansion (in a
        chains-only step, its top path's), whose head rows sit at the sequence's slots after
        its last token (one per internal node expanded): only where its pages reach that far
        (checked for the whole tree: the step's kind is not known per sequence here). Near
        max_tokens the scheduler reserves pages for fewer drafts than the tree has nodes, and
        such a sequence decodes plainly."""
        if k >= self.num_nodes:
            return self.num_nodes
        if len(seq.page_table) * self.page_size < seq.start_pos + max(len(self.internal), k) + 1:
            return 0
        return min(k, len(self.top_path))

    def plan(self, batch: BatchPlan, sampled: list[SeqWork], ks: list[int], wait) -> DraftLayout:
        granted = [self._granted(k, s) for k, s in zip(ks, sampled)]
        if all(g < self.num_nodes for g in granted):
            # Chains only: verified as causal chains, as MTP's (no tree mask, no tree walk).
            return DraftLayout.chains(granted, keep_hidden=True)
        shapes = [self.verified_shapes.get(g) for g in granted]  # None: no drafts
        depth = max((max(sh.depths) for sh in shapes if sh), default=self.depth)
        tree = TreeLayout([sh and sh.parents for sh in shapes], [sh and sh.order for sh in shapes],
                          [sh and sh.mask for sh in shapes], depth, self.tree.max_children(),
                          [sh and sh.top_path for sh in shapes])
        return DraftLayout(granted, self.num_nodes, [sh.depths if sh else [] for sh in shapes], tree,
                           keep_hidden=True)

    def propose(self, request: DraftRequest) -> Proposal:
        """→ draft tokens [S, W] (W: the tree's nodes, or the longest chain in a chains-only
        step; a chain's in its first columns; zeros for the sequences that draft nothing);
        q: one-hot."""
        granted, width = request.layout.num_drafts, request.layout.width
        grown = [i for i, k in enumerate(granted) if k]
        # Only chains this step: their tokens are the top path's, and expanding just that path
        # (one head row per level, as an MTP chain) spares the rest of the tree's expansion.
        chains_only = request.layout.tree is None
        only = set(self.top_path[:max(granted[i] for i in grown)]) if grown and chains_only else None
        nodes = self.propose_tree([request.seqs[i] for i in grown], only)  # [Sg, N]
        # Each grown sequence's columns: its tree's nodes, or its chain's top-path nodes.
        columns = [list(range(self.num_nodes)) if granted[i] == self.num_nodes else
                   [n - 1 for n in self.top_path[:granted[i]]] + [0] * (width - granted[i])
                   for i in grown]
        rows, picks = upload(nodes.device, (grown, torch.long), (columns, torch.long))
        tokens = torch.zeros(len(request.seqs), width, dtype=torch.long, device=nodes.device)
        return Proposal(tokens.index_copy(0, rows, nodes.gather(1, picks)), None)

    def after_verify(self, verified: Verified) -> None:
        pass  # never asked for: the head catches up after the sync

    def rows_for_level(self, level: int, only: set[int] | None = None) -> tuple[list[int], torch.Tensor]:
        """The internal nodes of depth <= level (of `only`, an ancestor-closed subset of the
        nodes, if given) and their [q, q] ancestor mask."""
        rows = [i for i in self.internal if self.node_depths[i - 1] <= level and (only is None or i in only)]
        index = {node: r for r, node in enumerate(rows)}
        mask = tree_mask_from_parents([index.get(self.node_parents[node - 1], -1) for node in rows])
        return rows, mask

    def _top_tokens(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """logits [B, V] → the k best tokens of each row [B, k], best first. With a trimmed draft
        vocabulary only its N columns can rank (the rest are -inf): top-k over those N, mapped
        back to token ids (a top-k over 49,152 columns cost ~0.09 ms a parent on a CPU)."""
        ids = self.head.vocab_ids
        if ids is None or ids.numel() < k:
            return torch.topk(logits, min(k, logits.shape[-1])).indices
        return ids[torch.topk(logits.index_select(1, ids), k).indices]

    def _levels(self, only: set[int] | None) -> list[_Level]:
        """The expansion levels for the nodes wanted (all, or `only`), made once per set: the
        tree's shape fixes them, and rebuilding them per step cost more than a tenth of a
        millisecond of host work a step."""
        key = None if only is None else frozenset(only)
        levels = self._level_plans.get(key)
        if levels is not None:
            return levels
        levels = []
        ranks, device = self.tree.ranks(), self.kv.k[0].device
        depth = self.depth if only is None else max(self.node_depths[n - 1] for n in only)
        for level in range(1, depth + 1):
            nodes = [n for n in range(1, self.num_nodes + 1)
                     if self.node_depths[n - 1] == level and (only is None or n in only)]
            draws = []
            for parent in sorted({self.node_parents[n - 1] for n in nodes}):
                children = [n for n in nodes if self.node_parents[n - 1] == parent]
                child_ranks = [ranks[n - 1] for n in children]
                draws.append((parent, *upload(device, (children, torch.long), (child_ranks, torch.long))))
            rows, mask = self.rows_for_level(level, only) if level < depth else ([], None)
            levels.append(_Level(draws, rows, upload(device, (rows, torch.long))[0],
                                 [self.node_parents[r - 1] for r in rows], mask,
                                 [self.node_depths[r - 1] - 1 for r in rows]))
            if not rows:
                break
        self._level_plans[key] = levels
        return levels

    def _tree_plan(self, only: set[int] | None):
        """The expansion levels for `only` as the head's one-call expansion reads them."""
        key = None if only is None else frozenset(only)
        plan = self._tree_plans.get(key)
        if plan is None:
            plan = self._tree_plans[key] = kernels.tree_plan(self._levels(only), self.num_nodes, self.top_k)
        return plan

    def propose_tree(self, seqs: list[SeqWork], only: set[int] | None = None) -> torch.Tensor:
        """→ node tokens [B, N] i64 for every sequence of `seqs` (the same shape for all).
        only: the nodes wanted (ancestor-closed, e.g. a prefix of the top path); the others'
        columns stay 0 and the head never runs on them."""
        b = len(seqs)
        device = self.kv.k[0].device
        logits, root_hidden = self.carried_rows([s.seq_id for s in seqs])  # the root's head output
        # The levels below in one call where the head's fused call applies (the CPU backend).
        tokens = self.head.expand_tree(lambda: self._tree_plan(only), logits, root_hidden,
                                       [s.start_pos for s in seqs], [s.page_table for s in seqs], self.backend,
                                       self.kv, self.page_size)
        if tokens is not None:
            return tokens
        tokens = torch.zeros(b, self.num_nodes + 1, dtype=torch.long, device=device)  # col 0: root
        # Per node: the head output its children are ranked from (root: the carried logits).
        node_logits: dict[int, torch.Tensor] = {0: logits}
        node_hidden: dict[int, torch.Tensor] = {0: root_hidden}
        for level in self._levels(only):
            # 1. this level's nodes get their tokens from their parents' top-ranked tokens
            for parent, nodes, ranks in level.draws:
                tokens[:, nodes] = self._top_tokens(node_logits[parent], self.top_k)[:, ranks]
            if not level.rows:
                break
            # 2. the head over every internal node so far (ancestors visible), for the next level
            q = len(level.rows)
            ids = tokens[:, level.row_index].reshape(-1)  # [B*q]
            hidden = torch.stack([node_hidden[p] for p in level.row_parents], dim=1).reshape(b * q, -1)
            # The root x_n sits at position n; a row of depth d drafts from position n - 1 + d.
            positions = [s.start_pos + offset for s in seqs for offset in level.depth_offsets]
            attn = [SeqAttention(q, s.start_pos + q, s.page_table, tree_mask=level.mask) for s in seqs]
            out_logits, out_hidden = self._run(ids, [hidden], positions, attn, list(range(b * q)))
            out_logits, out_hidden = out_logits.view(b, q, -1), out_hidden.view(b, q, -1)
            for j, r in enumerate(level.rows):
                node_logits[r], node_hidden[r] = out_logits[:, j], out_hidden[:, j]
        return tokens[:, 1:]


class _Level(NamedTuple):
    """One expansion level of EagleProposer.propose_tree, fixed by the tree's shape (in this
    field order the one-call expansion reads it too: kernels.tree_plan)."""

    draws: list[tuple[int, torch.Tensor, torch.Tensor]]  # (a parent, its children here [c] i64, their ranks [c] i64)
    rows: list[int]  # the internal nodes of depth <= level the head runs on next (none: the last level)
    row_index: torch.Tensor  # [q] i64: rows, as `tokens` columns
    row_parents: list[int]  # each row's parent: whose head hidden the row reads
    mask: torch.Tensor | None  # [q, q] bool: the rows' ancestor mask
    depth_offsets: list[int]  # each row's depth - 1: its position past the root's


@dataclass(frozen=True)
class DynamicTree:
    """One sequence's EAGLE-2 tree, known on the host: nodes 1..N parents first."""

    tokens: list[int]
    parents: list[int]  # 0 = root
    depths: list[int]
    order: list[int]  # index among siblings, best first

    @property
    def mask(self) -> torch.Tensor:
        return tree_mask_from_parents([-1] + self.parents)


class DynamicEagleProposer(HeadProposer):
    """EAGLE-2 (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic
    Draft Trees"): the tree's shape follows the head's confidence. Each level expands the
    `topk` nodes with the highest cumulative draft log-probability (each into its `topk`
    best children); after `depth` levels every candidate is reranked by cumulative
    log-probability and the best `tokens` are verified (a child never outranks its parent,
    so the kept set is a tree).

    The shape is data, and the verify pass's layout (positions, the tree mask) is planned on
    the host, so this proposer grows its trees while the step is prepared (`plan`) and reads
    each level's selection back to the host: a documented sync per level (it first waits for
    the previous step's catch-up, whose carried logits it expands). The fixed-shape
    EagleProposer has none of these syncs; that is the price of the dynamic shape here.
    """

    name = "eagle-dynamic"

    def __init__(self, head: MTPHead, backend: AttentionBackend, num_pages: int, page_size: int,
                 depth: int, topk: int, tokens: int, scratch_page: int | None = None):
        super().__init__(head, backend, num_pages, page_size, scratch_page)
        self.topk, self.max_nodes = topk, tokens
        self.depth = min(depth, tokens)  # a tree of `tokens` nodes is at most that deep
        self.num_nodes = min(tokens, topk + (depth - 1) * topk * topk)

    def plan(self, batch: BatchPlan, sampled: list[SeqWork], ks: list[int], wait) -> DraftLayout:
        grows = [k >= self.num_nodes for k in ks]  # all or nothing (the top path may not be in it)
        trees: list[DynamicTree | None] = [None] * len(ks)
        if any(grows):
            # The trees grow from the logits the previous step's catch-up carries: wait for it
            # (the documented sync of dynamic trees; expand reads each level back as well).
            wait()
            grown = [i for i, g in enumerate(grows) if g]
            for i, t in zip(grown, self.expand([sampled[i] for i in grown])):
                trees[i] = t
        tree = TreeLayout([t.parents if t else None for t in trees], [t.order if t else None for t in trees],
                          [t.mask if t else None for t in trees], self.depth, self.topk)
        return DraftLayout([self.num_nodes if t else 0 for t in trees], self.num_nodes,
                           [t.depths if t else [] for t in trees], tree,
                           tokens=[t.tokens if t else [] for t in trees], keep_hidden=True)

    def propose(self, request: DraftRequest) -> Proposal:
        # Grown while planning, staged with the step's inputs; q: one-hot.
        return Proposal(request.host_tokens, None)

    def after_verify(self, verified: Verified) -> None:
        pass  # never asked for: the head catches up after the sync

    def expand(self, seqs: list[SeqWork]) -> list[DynamicTree]:
        b, k = len(seqs), self.topk
        logits, hidden0 = self.carried_rows([s.seq_id for s in seqs])
        # Candidate pool per sequence: (cum logp, token, parent candidate id or -1, depth).
        pool: list[list[tuple[float, int, int, int]]] = [[] for _ in range(b)]
        logp, tok = torch.topk(torch.log_softmax(logits, -1), k)
        # The documented sync of dynamic trees: each level's choice is read back.
        for i, (lp, tk) in enumerate(zip(logp.tolist(), tok.tolist())):
            pool[i] = [(lp[j], tk[j], -1, 1) for j in range(k)]
        frontier = [list(range(k)) for _ in range(b)]  # candidate ids expanded next
        expanded: list[list[int]] = [[] for _ in range(b)]  # candidate ids the head has run on
        out_hidden: list[dict[int, torch.Tensor]] = [dict() for _ in range(b)]
        for level in range(2, self.depth + 1):
            for i in range(b):
                expanded[i] += frontier[i]
            # 1. the head over every expanded node so far (ancestors visible), batched
            ids, hid, positions, attn, last = [], [], [], [], []
            for i, s in enumerate(seqs):
                index = {c: r for r, c in enumerate(expanded[i])}
                parents = [index.get(pool[i][c][2], -1) for c in expanded[i]]
                for c in expanded[i]:
                    _, t, parent, depth = pool[i][c]
                    ids.append(t)
                    hid.append(hidden0[i] if parent < 0 else out_hidden[i][parent])
                    positions.append(s.start_pos - 1 + depth)
                q = len(expanded[i])
                attn.append(SeqAttention(q, s.start_pos + q, s.page_table, tree_mask=tree_mask_from_parents(parents)))
                last += range(len(ids) - q, len(ids))
            out_logits, out_h = self._run(ids, hid, positions, attn, last)
            logp, tok = torch.topk(torch.log_softmax(out_logits, -1), k)
            logp, tok = logp.tolist(), tok.tolist()  # this level's documented sync (see the class doc)
            # 2. children of this level's frontier; the next frontier = the best k of them
            row = 0
            for i in range(b):
                new = []
                for c in expanded[i]:
                    out_hidden[i][c] = out_h[row]
                    if c in frontier[i]:
                        cum, _, _, depth = pool[i][c]
                        for j in range(k):
                            pool[i].append((cum + logp[row][j], tok[row][j], c, depth + 1))
                            new.append(len(pool[i]) - 1)
                    row += 1
                frontier[i] = sorted(new, key=lambda c: -pool[i][c][0])[:k]
        return [self._rerank(p) for p in pool]

    def _rerank(self, pool: list[tuple[float, int, int, int]]) -> DynamicTree:
        keep = sorted(range(len(pool)), key=lambda c: (-pool[c][0], pool[c][3]))[: self.num_nodes]
        keep.sort(key=lambda c: (pool[c][3], -pool[c][0]))  # parents first, best first
        node = {c: i + 1 for i, c in enumerate(keep)}
        parents = [node.get(pool[c][2], 0) for c in keep]
        order, seen = [], {}
        for p in parents:
            order.append(seen.get(p, 0))
            seen[p] = seen.get(p, 0) + 1
        return DynamicTree([pool[c][1] for c in keep], parents, [pool[c][3] for c in keep], order)
