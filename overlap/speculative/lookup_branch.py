"""A prompt-lookup branch beside the head's drafts: the MTP chain or EAGLE tree of a step,
plus the n-gram continuation of the sequence's own history (ngram.lookup) as one more child
of the root, verified in the same target pass under a tree mask.

Why: the two drafters fail in different places. The head predicts the next few tokens from
the target's states and its accuracy falls with depth (dev prompts, mtp:3: 0.57 / 0.35 / 0.22
of steps reach depths 1 / 2 / 3); a lookup copies what followed the last occurrence of the
context's suffix, and when the target copies (arguments of the signature it documents, a
repeated line, a list it enumerates) the copy is right for many tokens (n-gram k=4: 0.41 /
0.29 / 0.26 / 0.24). Replaying the head's steps on the dev prompts with a lookup beside each
(runs/prof/hybrid_analyse.py) gave code 2.31 -> 3.15 and chat 1.98 -> 2.26 tokens a step
for a 4-token branch, before the trajectory changes.

The verified shape, per sequence that drafts this step and finds a lookup of L' >= 1 tokens:
nodes 1..b are the head's (a chain: node i's parent is node i-1; a tree: its own shape), nodes
b+1..b+L' the branch (a chain from the root). The branch's first node is tried FIRST among
the root's children: when its token is the target's choice the walk follows the copy, which
usually runs longer than the head's chain where both start right; otherwise the head's
children are tried as before. Trying it first changes which candidates are verified, never
what is emitted: verify_tree's residual rule accepts any fixed order of one-hot drafts
losslessly (tree.py). A greedy walk (verify_tree_greedy) takes, of two children with the
target's token, the one whose matches run deeper: a short copy no longer cuts a longer
right chain of the head's.

Sampled requests: the tree verifier treats every draft as one-hot, the head's sampled MTP
drafts too. That stays exact (a draft x accepted with probability p(x), else the token drawn
from p without x: the output's law is p for any x drawn independently of the verification's
noise), at a lower acceptance than the chain verifier's min(1, p/q) for those drafts. A step
where no sequence finds a branch is the head's step unchanged (chain verification with q).

The head's catch-up re-runs every accepted row with the target's hidden states whoever
drafted them (head_proposer.py), so a branch token accepted leaves the head exactly where an
accepted head draft would. The draft model (draft_target.py) catches up from the first token
it has not run through its own KV, trusting the KV of its accepted drafts: after a step whose
walk followed the branch those positions hold its chain, not the accepted copy, so it is told
that none of its drafts was accepted (`_as_the_chain_saw_it`) and re-runs every produced token.
A walk that followed the branch accepted a draft and produced the branch's first token first
(a sampled walk then always followed it: the branch is tried first at the root, and once
refused its token leaves the residual; a greedy walk may have taken the chain's equal
token): such a step re-runs, at worst a few rows the draft already held.

Rows: the scheduler reserves SeqWork.lookup_rows slots beyond the drafts (its room before
max_tokens and the context end), and the branch never takes more. A branch is taken only after
a match of spec.lookup_min_match (2) tokens: every branch costs target rows, and the replay
above found 1-token matches on twice the steps for almost no more copied tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgspec
import torch

from overlap.attention.base import tree_mask_from_parents
from overlap.batch import BatchPlan, SeqWork
from overlap.speculative.base import DraftLayout, DraftRequest, FinishedStep, Proposal, TreeLayout, Verified
from overlap.speculative.ngram import follow, lookup

# Marks a draft the proposer fills in on the device in a layout's host tokens.
ON_DEVICE = -1


@dataclass(frozen=True)
class BranchedLayout(DraftLayout):
    """The step's layout with the branches added, and the inner proposer's own layout (what
    its propose() is given): the two travel together, because the next step is planned while
    this one's propose() runs."""

    inner: DraftLayout | None = None


class LookupBranch:
    """Wraps a model drafter (MTPProposer, EagleProposer, DraftTargetProposer) with a lookup
    branch of up to `length` tokens per sequence (module doc)."""

    def __init__(self, inner, length: int, n_min: int, n_max: int):
        if length < 1:
            raise ValueError(f"a lookup branch needs a length >= 1, got {length}")
        self.inner, self.length = inner, length
        self.n_min, self.n_max = n_min, n_max
        self.name = f"{inner.name}+lookup"
        self.state_on_host = inner.state_on_host
        # seq_id → every token of the sequence known on the host (prompt and output)
        self.history: dict[int, list[int]] = {}
        # A drafter whose catch-up trusts the KV of its own accepted drafts (the draft model)
        # must hear which steps' walks followed a branch instead (module doc).
        self.inner_trusts_own_drafts = getattr(inner, "trusts_own_drafts", False)
        # (seq_id, start_pos) of a branched step → (its chain's drafts, the branch's first
        # token); written when planned, read at that step's catch-up (on the forward stream,
        # possibly after the next step is planned: hence keyed by the step's position too).
        self.branched: dict[tuple[int, int], tuple[int, int]] = {}

    def graph_runners(self) -> list:
        return self.inner.graph_runners()

    # -- host: what each sequence verifies ---------------------------------------------

    def plan(self, batch: BatchPlan, sampled: list[SeqWork], ks: list[int], wait) -> DraftLayout:
        inner = self.inner.plan(batch, sampled, ks, wait)
        # 1. a lookup for every sequence that drafts this step, within its reserved rows: the
        # scheduler's where it looked up (what its controller priced), else on our history
        found = [self._found(s) if k and s.lookup_rows else [] for s, k in zip(sampled, inner.num_drafts)]
        if not any(found):
            return inner  # the head's step as it was (its chain verification, its q)
        # 2. each sequence's nodes: the head's (chain or tree), then its branch from the root
        parents, order, masks, depths, tokens, num_drafts = [], [], [], [], [], []
        for j, (k, branch) in enumerate(zip(inner.num_drafts, found)):
            if not k:  # no drafts this step: no nodes
                for column, empty in ((parents, None), (order, None), (masks, None), (depths, []), (tokens, []),
                                      (num_drafts, 0)):
                    column.append(empty)
                continue
            base_parents, base_order = self._inner_shape(inner, j, k)
            b = len(base_parents)
            # The branch's first node is tried first at the root: the head's children move one back.
            shifted = [o + 1 if p == 0 and branch else o for p, o in zip(base_parents, base_order)]
            branch_parents = [0] + [b + i for i in range(1, len(branch))] if branch else []
            node_parents = base_parents + branch_parents
            parents.append(node_parents)
            order.append(shifted + [0] * len(branch))
            masks.append(tree_mask_from_parents([-1] + node_parents))
            depths.append(list(inner.depths[j]) + list(range(1, len(branch) + 1)))
            head_tokens = list(inner.tokens[j]) if inner.tokens is not None else [ON_DEVICE] * b
            tokens.append(head_tokens + branch)
            num_drafts.append(b + len(branch))
            if branch and self.inner_trusts_own_drafts:
                self.branched[(sampled[j].seq_id, sampled[j].start_pos)] = (k, branch[0])
        max_children = (inner.tree.max_children if inner.tree is not None else 1) + 1
        # The head's nodes keep their ids (1..b): its top path is the inner layout's (a chain: all
        # of it; a tree that reports none, as EAGLE-2's grown ones, still none).
        if inner.tree is None:
            top = [list(range(1, k + 1)) if k else None for k in inner.num_drafts]
        else:
            top = inner.tree.top_path
        tree = TreeLayout(parents, order, masks, max(max(d) for d in depths if d), max_children, top)
        return BranchedLayout(num_drafts, inner.width + self.length, depths, tree, tokens,
                              keep_hidden=inner.keep_hidden, device_fills=inner.tokens is None, inner=inner)

    def _found(self, seq: SeqWork) -> list[int]:
        rows = min(self.length, seq.lookup_rows)
        if seq.branch is not None:
            return seq.branch[:rows]
        return lookup(self.history.get(seq.seq_id, []), rows, self.n_min, self.n_max)

    @staticmethod
    def _inner_shape(inner: DraftLayout, j: int, k: int) -> tuple[list[int], list[int]]:
        """The head's nodes of sequence j: (parents, sibling order), nodes 1..k."""
        if inner.tree is not None and inner.tree.parents[j] is not None:
            return list(inner.tree.parents[j][:k]), list(inner.tree.order[j][:k])
        return list(range(k)), [0] * k  # a chain: node i's parent is node i - 1

    # -- device: the step's drafts -----------------------------------------------------

    def propose(self, request: DraftRequest) -> Proposal:
        layout = request.layout
        if not isinstance(layout, BranchedLayout):
            return self.inner.propose(request)
        if not layout.device_fills:
            return Proposal(request.host_tokens, None)  # every draft known on the host (EAGLE-2)
        head = self.inner.propose(DraftRequest(request.seqs, layout.inner, request.sampling, None))
        # [S, W]: the host's tokens (the branches) where known, the head's drafts elsewhere.
        # The head's columns are its own 0..b-1 in both layouts; q: one-hot (module doc).
        host = request.host_tokens
        drafted = torch.zeros_like(host)
        drafted[:, :head.tokens.shape[1]] = head.tokens
        return Proposal(torch.where(host == ON_DEVICE, drafted, host), None)

    def after_verify(self, verified: Verified) -> None:
        self.inner.after_verify(verified)

    # -- after the step ------------------------------------------------------------------

    def observe(self, finished: FinishedStep) -> None:
        """On the host, right after the step's sync: the produced tokens join each sequence's
        history before the next step is planned (the inner catch-up runs later, on the
        forward stream)."""
        follow(self.history, finished)

    def catch_up(self, finished: FinishedStep) -> None:
        if self.inner_trusts_own_drafts:
            finished = self._as_the_chain_saw_it(finished)
        self.inner.catch_up(finished)

    def _as_the_chain_saw_it(self, finished: FinishedStep) -> FinishedStep:
        """The step's outputs as the inner drafter's chain saw them: on a branched step, its own
        drafts (k) and how many of them were accepted: none where the walk may have followed
        the branch, else the path's length (a path along the chain never runs past k)."""
        outputs = []
        for s, out in zip(finished.seqs, finished.outputs):
            chain = self.branched.pop((s.seq_id, s.start_pos), None)
            if chain is not None:
                k, branch_first = chain
                maybe_branch = out.num_accepted > 0 and out.token_ids[0] == branch_first
                out = msgspec.structs.replace(out, num_drafts=k, num_accepted=0 if maybe_branch else out.num_accepted)
            outputs.append(out)
        return dataclasses.replace(finished, outputs=outputs)

    def release(self, seq_ids: list[int]) -> None:
        gone = set(seq_ids)
        for i in seq_ids:
            self.history.pop(i, None)
        # list(): one atomic copy of the keys; plan() may add one on the host thread meanwhile.
        for key in [key for key in list(self.branched) if key[0] in gone]:
            self.branched.pop(key, None)
        self.inner.release(seq_ids)
