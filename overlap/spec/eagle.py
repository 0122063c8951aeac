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
target's hidden states (MTPProposer.catch_up), which overwrites its expansion rows.
"""

from __future__ import annotations

import torch

from overlap.attention.base import AttentionBackend, SeqAttention, tree_mask_from_parents
from overlap.batch import SeqWork
from overlap.models.heads import MTPHead
from overlap.sampling import SamplingTensors
from overlap.spec.mtp import MTPProposer
from overlap.spec.tree import TreeShape


class EagleProposer(MTPProposer):
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
        # Verification mask over [root, nodes]: each row sees the root and its ancestors.
        self.verify_mask = tree_mask_from_parents([-1] + parents)
        self.verify_depths = [0] + depths

    def rows_for_level(self, level: int) -> tuple[list[int], torch.Tensor]:
        """The internal nodes of depth <= level and their [q, q] ancestor mask."""
        rows = [i for i in self.internal if self.node_depths[i - 1] <= level]
        index = {node: r for r, node in enumerate(rows)}
        mask = tree_mask_from_parents([index.get(self.node_parents[node - 1], -1) for node in rows])
        return rows, mask

    def propose_tree(self, seqs: list[SeqWork]) -> torch.Tensor:
        """→ node tokens [B, N] i64 for every sequence (the same shape for all)."""
        b = len(seqs)
        device = self.kv.k[0].device
        logits = torch.stack([self.carried[s.seq_id][0] for s in seqs])  # [B, V] root's head output
        root_hidden = torch.stack([self.carried[s.seq_id][1] for s in seqs])  # [B, H]
        tokens = torch.zeros(b, self.num_nodes + 1, dtype=torch.long, device=device)  # col 0: root
        # Per node: the head output its children are ranked from (root: the carried logits).
        node_logits: dict[int, torch.Tensor] = {0: logits}
        node_hidden: dict[int, torch.Tensor] = {0: root_hidden}
        ranks = self.tree.ranks()
        for level in range(1, self.depth + 1):
            # 1. this level's nodes get their tokens from their parents' top-ranked tokens
            top = {p: torch.topk(node_logits[p], min(max(ranks) + 1, node_logits[p].shape[-1])).indices
                   for p in node_logits}
            for node in range(1, self.num_nodes + 1):
                if self.node_depths[node - 1] == level:
                    tokens[:, node] = top[self.node_parents[node - 1]][:, ranks[node - 1]]
            if level == self.depth:
                break
            # 2. the head over every internal node so far (ancestors visible), for the next level
            rows, mask = self.rows_for_level(level)
            if not rows:
                break
            q = len(rows)
            ids = tokens[:, rows].reshape(-1)  # [B*q]
            hidden = torch.stack([node_hidden[self.node_parents[r - 1]] for r in rows], dim=1).reshape(b * q, -1)
            positions, attn = [], []
            for s in seqs:
                n = s.start_pos  # the root x_n's position
                positions += [n - 1 + self.node_depths[r - 1] for r in rows]
                attn.append(SeqAttention(q, n + q, s.page_table, tree_mask=mask))
            out_logits, out_hidden = self._run(ids, hidden, positions, attn, list(range(b * q)))
            out_logits, out_hidden = out_logits.view(b, q, -1), out_hidden.view(b, q, -1)
            for j, r in enumerate(rows):
                node_logits[r], node_hidden[r] = out_logits[:, j], out_hidden[:, j]
        return tokens[:, 1:]

    def propose(self, seqs: list[SeqWork], ks: list[int], sampling: SamplingTensors):
        raise RuntimeError("the EAGLE drafter proposes trees (propose_tree); the executor verifies them")
