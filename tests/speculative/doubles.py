"""Test doubles: broken verifiers, a random speculation controller, a minimal proposer.

Broken verifiers show the statistical tests have power.

Each is a copy of the real verifier (overlap/speculative/rejection.py, overlap/speculative/tree.py) with one
realistic bug switched on; with no bug switched on it is the real one, token for token
(test_rejection_stats checks that), so a rejection of a broken one is due to its bug alone.

- residual=False: the recovered token after a rejection is drawn from p instead of the
  residual norm(max(p - q, 0)) (a tree keeps testing siblings against p, not the residual).
- accept_offset=1: the accept test min(1, p/q) reads p from the wrong row: the target's
  distribution one position further on (the row after the draft, an off-by-one).
- at_depth=d: the bug bites only at draft depth d (1-based; None: at every depth), e.g. only
  at the deepest draft, which a test that never verifies that depth cannot see.
"""

from __future__ import annotations

import functools

import torch

from overlap.attention.base import tree_mask_from_parents
from overlap.device import upload
from overlap.sampling import NOISE_SAMPLE, NOISE_TREE, race, uniform_noise
from overlap.speculative.base import DraftLayout, Proposal, TreeLayout
from overlap.speculative.rejection import _position_uniforms
from overlap.speculative.tree import TreeShape, children_table


def verify_chain(target_probs, draft_probs, draft_tokens, num_drafts, seed, first_position, *,
                 residual: bool = True, accept_offset: int = 0, at_depth: int | None = None):
    if draft_probs is None:  # deterministic drafts (the real verifier's one-hot q, made explicit)
        draft_probs = torch.nn.functional.one_hot(draft_tokens, target_probs.shape[-1]).to(target_probs.dtype)
    b, k, vocab = draft_probs.shape
    rows = torch.arange(b, device=draft_tokens.device)
    cols = torch.arange(k, device=draft_tokens.device)
    bitten = cols + 1 == at_depth if at_depth else torch.ones(k, dtype=torch.bool)  # [K]
    p_x = target_probs[:, :k].gather(2, draft_tokens[:, :, None])[..., 0]
    if accept_offset:  # p of the row after the draft (the last draft's: the bonus row)
        wrong = target_probs[:, accept_offset:].gather(2, draft_tokens[:, :, None])[..., 0]
        p_x = torch.where(bitten[None, :], wrong, p_x)
    q_x = draft_probs.gather(2, draft_tokens[:, :, None])[..., 0]
    u = _position_uniforms(seed, first_position[:, None] + cols[None, :])
    accepted = (u * q_x < p_x) & (cols[None, :] < num_drafts[:, None])
    num_accepted = torch.cumprod(accepted.long(), dim=1).sum(dim=1)
    p_end = target_probs[rows, num_accepted]
    all_accepted = num_accepted == num_drafts
    q_end = draft_probs[rows, num_accepted.clamp(max=k - 1)] if k > 0 else torch.zeros_like(p_end)
    res = (p_end - q_end).clamp_min(0)
    mass = res.sum(-1, keepdim=True)
    res = torch.where(mass > 0, res / mass.clamp_min(1e-30), p_end)
    if not residual and k > 0:  # the recovered token from p, where the rejection is at a bitten depth
        res = torch.where(bitten[num_accepted.clamp(max=k - 1)][:, None], p_end, res)
    extra_probs = torch.where(all_accepted[:, None], p_end, res)
    extra = race(extra_probs, seed, first_position + num_accepted, NOISE_SAMPLE)
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(b, 1)], dim=1)
    tokens = tokens.scatter(1, num_accepted[:, None], extra[:, None])
    return tokens, num_accepted


def verify_tree(target_probs, tokens, parents, order, depth, max_children, seed, first_position, *,
                residual: bool = True, accept_offset: int = 0, at_depth: int | None = None):
    b = tokens.shape[0]
    rows = torch.arange(b, device=tokens.device)
    children = children_table(parents, order, max_children)
    node_tokens = torch.cat([tokens.new_zeros(b, 1), tokens], dim=1)
    current = torch.zeros(b, dtype=torch.long, device=tokens.device)
    alive = torch.ones(b, dtype=torch.bool, device=tokens.device)
    num_accepted = torch.zeros(b, dtype=torch.long, device=tokens.device)
    path = torch.zeros(b, depth, dtype=torch.long, device=tokens.device)
    p_res = target_probs[:, 0]
    for d in range(depth):
        bitten = at_depth is None or d + 1 == at_depth
        u = uniform_noise(seed, first_position + d, NOISE_TREE, max_children)
        took = torch.zeros(b, dtype=torch.bool, device=tokens.device)
        for j in range(max_children):
            child = children[rows, current, j]
            tried = alive & ~took & (child > 0)
            tok = node_tokens[rows, child]
            # accept_offset=1: p read from the child's own row (the target after the child).
            p_tok = (target_probs[rows, child] if accept_offset and bitten else p_res)[rows, tok]
            accept = tried & (u[:, j] < p_tok)
            refused = tried & ~accept
            cut = p_res.scatter(1, tok[:, None], 0.0)
            mass = cut.sum(-1, keepdim=True)
            if residual or not bitten:
                p_res = torch.where(refused[:, None] & (mass > 0), cut / mass.clamp_min(1e-30), p_res)
            current = torch.where(accept, child, current)
            path[:, d] = torch.where(accept, child, path[:, d])
            took |= accept
        num_accepted += took.long()
        alive &= took
        p_res = torch.where(took[:, None], target_probs[rows, current], p_res)
    extra = race(p_res, seed, first_position + num_accepted, NOISE_SAMPLE)
    out = torch.cat([node_tokens.gather(1, path), tokens.new_zeros(b, 1)], dim=1)
    out = out.scatter(1, num_accepted[:, None], extra[:, None])
    return out, num_accepted, path


BUGS = {"no_residual": dict(residual=False), "wrong_row": dict(accept_offset=1)}


def broken(bug: str, at_depth: int | None = None) -> dict:
    return {**BUGS[bug], "at_depth": at_depth}


def patch_verifier(monkeypatch, bug: str, at_depth: int | None = None) -> None:
    """Make the executor verify chains and trees with this bug (at this depth only)."""
    import overlap.executor

    kw = broken(bug, at_depth)
    monkeypatch.setattr(overlap.executor, "verify_chain", functools.partial(verify_chain, **kw))
    monkeypatch.setattr(overlap.executor, "verify_tree", functools.partial(verify_tree, **kw))


class RandomChoices:
    """A speculation controller that picks each decoding sequence's option at random (seeded):
    every step mixes chains of different lengths, trees and plain rows, which a real
    controller would only do on some workloads; and cuts the step's lookup branches to a
    random length (branch_cap). Counts what it chose, per option."""

    def __init__(self, seed: int = 0, plain_weight: float = 0.25):
        import random

        self.rng = random.Random(seed)
        self.plain_weight = plain_weight
        self.chosen: dict[int, int] = {}
        self.mixed_steps = 0  # steps whose decoding sequences did not all get the same option
        self.branch_cap = 16

    def choose(self, candidates, other_rows=0, other_tokens=0):
        self.branch_cap = self.rng.choice([1, 3, 16])
        picked = []
        for c in candidates:
            if len(c.options) > 1 and self.rng.random() >= self.plain_weight:
                picked.append(self.rng.choice(c.options[1:]))
            else:
                picked.append(c.options[0])
        for o in picked:
            self.chosen[o.k] = self.chosen.get(o.k, 0) + 1
        self.mixed_steps += len({o.k for o in picked}) > 1
        return picked

    def observe(self, key, num_drafts, num_accepted, tree=False, depth=0, branch_rows=None, top_accepted=-1):
        pass

    def observe_step(self, rows, drafter_rows, seconds, speculating=0, catch_up_rows=0, tree=False, prompt_rows=0):
        pass

    def should_detach(self, key):
        return False

    def admits_drafts(self, batch, options, others=0):
        return True

    def forget(self, key):
        pass

    def stats(self):
        return {"spec_k_histogram": {str(k): n for k, n in sorted(self.chosen.items())}}


class OracleProposer:
    """A proposer built on the public interface alone (overlap/speculative/base.py), no model:
    it knows each sequence's greedy continuation (`references`: prompt + greedy output) and
    drafts it, wrong at some depths (so verification rejects, recovers and carries on).

    chain: k drafts; tree: `shape`, whose rank-0 path is the oracle's unless a depth is
    spoiled, then its rank-1 child holds the right token (the verifier must try a sibling).
    host: the drafts go in the layout (known on the host); else propose() makes them on the
    device. Its history lives on the host and follows every token (its own catch-up rule)."""

    name = "oracle"
    state_on_host = True

    def __init__(self, references: list[list[int]], vocab_size: int, shape: TreeShape | None = None,
                 host: bool = False):
        self.references, self.vocab = references, vocab_size
        self.shape, self.host = shape, host
        self.history: dict[int, list[int]] = {}
        self.planned: list[list[int]] = []  # device drafters: drafts known since plan, for propose
        self.proposed = self.accepted = 0

    def _truth(self, seq_id: int, count: int) -> list[int]:
        hist = self.history[seq_id]
        ref = next(r for r in self.references if r[:len(hist)] == hist)
        return (ref[len(hist):len(hist) + count] + [0] * count)[:count]

    def _spoiled(self, seq_id: int, depth: int) -> bool:
        return (seq_id + len(self.history[seq_id]) + depth) % 3 == 0

    def _chain(self, seq_id: int, k: int) -> list[int]:
        truth = self._truth(seq_id, k)
        return [(t + 1) % self.vocab if self._spoiled(seq_id, d + 1) else t for d, t in enumerate(truth)]

    def _tree(self, seq_id: int) -> list[int]:
        truth = self._truth(seq_id, self.shape.depth)
        # The rank that holds the true token at each depth: 0, or 1 where the depth is spoiled.
        right = [1 if self._spoiled(seq_id, d) else 0 for d in range(1, self.shape.depth + 1)]
        nodes = []
        for path in self.shape.paths:
            d = len(path)
            if list(path) == right[:d]:
                nodes.append(truth[d - 1])
            else:
                nodes.append((truth[d - 1] + 1 + path[-1]) % self.vocab)
        return nodes

    # -- the interface --------------------------------------------------------------------

    def graph_runners(self) -> list:
        return []

    def plan(self, batch, sampled, ks, wait) -> DraftLayout:
        if self.shape is None:
            drafts = [self._chain(s.seq_id, k) if k else [] for s, k in zip(sampled, ks)]
            layout = DraftLayout.chains(ks, tokens=drafts if self.host else None)
        else:
            n = self.shape.size
            grows = [k >= n for k in ks]
            drafts = [self._tree(s.seq_id) if g else [] for s, g in zip(sampled, grows)]
            parents, order = self.shape.parents(), self.shape.sibling_order()
            mask = tree_mask_from_parents([-1] + parents)
            tree = TreeLayout([parents if g else None for g in grows], [order if g else None for g in grows],
                              [mask if g else None for g in grows], self.shape.depth, self.shape.max_children())
            layout = DraftLayout([n if g else 0 for g in grows], n, [self.shape.depths() if g else [] for g in grows],
                                 tree, tokens=drafts if self.host else None)
        self.planned = [d + [0] * (layout.width - len(d)) for d in drafts]
        return layout

    def propose(self, request) -> Proposal:
        if request.host_tokens is not None:
            return Proposal(request.host_tokens, None)
        tokens, = upload(request.sampling.seed.device, (self.planned, torch.long))
        return Proposal(tokens, None)  # deterministic drafts: q one-hot

    def after_verify(self, verified) -> None:
        raise AssertionError("the layout never asks for a catch-up inside the launch")

    def observe(self, finished) -> None:
        pass

    def catch_up(self, finished) -> None:
        for s, out, _ in finished.followed():
            hist = self.history.setdefault(s.seq_id, [])
            del hist[s.start_pos:]  # a recompute after preemption restarts at 0
            hist += s.token_ids + out.token_ids
            self.proposed += out.num_drafts
            self.accepted += out.num_accepted

    def release(self, seq_ids) -> None:
        for i in seq_ids:
            self.history.pop(i, None)
