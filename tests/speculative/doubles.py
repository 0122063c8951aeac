"""Broken verifiers: test doubles that show the statistical tests have power.

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

from overlap.sampling import NOISE_SAMPLE, NOISE_TREE, race, uniform_noise
from overlap.speculative.rejection import _position_uniforms
from overlap.speculative.tree import children_table


def verify_chain(target_probs, draft_probs, draft_tokens, num_drafts, seed, first_position, *,
                 residual: bool = True, accept_offset: int = 0, at_depth: int | None = None):
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
    controller would only do on some workloads. Counts what it chose, per option."""

    def __init__(self, seed: int = 0, plain_weight: float = 0.25):
        import random

        self.rng = random.Random(seed)
        self.plain_weight = plain_weight
        self.chosen: dict[int, int] = {}
        self.mixed_steps = 0  # steps whose decoding sequences did not all get the same option

    def choose(self, candidates, other_rows=0, other_tokens=0):
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

    def observe(self, key, num_drafts, num_accepted):
        pass

    def observe_step(self, rows, drafter_rows, seconds, speculative=False):
        pass

    def should_detach(self, key):
        return False

    def forget(self, key):
        pass

    def stats(self):
        return {"spec_k_histogram": {str(k): n for k, n in sorted(self.chosen.items())}}
