"""Lossless verification of draft chains (speculative sampling).

Terms, used with these meanings everywhere in overlap (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating
Large Language Model Decoding with Speculative Sampling"):

- draft: a token proposed by a cheap drafter, x_i ~ q_i (q: the drafter's distribution after
  the request's temperature / top-k / top-p; one-hot for deterministic drafters).
- accepted: a draft the target keeps. x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i))
  (p: the target's distribution at the same position), checked in order; the first rejection
  ends the chain. For greedy requests p and q are one-hot, so this is "argmax matches".
- recovered: the token emitted at the first rejected position, drawn from the residual
  normalize(max(0, p_i - q_i)). Accepted-or-recovered tokens follow p exactly.
- bonus: when all k drafts are accepted, one more token drawn from p_{k+1}, which the verify
  pass computed for free.
A step therefore emits accepted + 1 tokens (1 .. k+1). All of it runs on the device: the
accept test, the residual draw and the bonus draw are batched over sequences with different
draft counts, with counter-based noise (see sampling.py), and nothing is read back here.
"""

from __future__ import annotations

import torch

from overlap.sampling import NOISE_ACCEPT, NOISE_SAMPLE, race, uniform_noise


def verify_greedy(
    target_best: torch.Tensor,  # [B, K+1] i64: the target's argmax after each prefix
    draft_tokens: torch.Tensor,  # [B, K] i64
    num_drafts: torch.Tensor,  # [B] i64
) -> tuple[torch.Tensor, torch.Tensor]:
    """verify_chain when every request is greedy: p is one-hot at the target's argmax, so a
    draft is accepted iff it is that argmax, and the recovered / bonus token is the argmax at
    the end of the accepted prefix. No probabilities, no noise: an argmax compare and a
    cumulative product. Same outputs as verify_chain on one-hot p."""
    k = draft_tokens.shape[1]
    cols = torch.arange(k, device=draft_tokens.device)
    accepted = (draft_tokens == target_best[:, :k]) & (cols[None, :] < num_drafts[:, None])
    num_accepted = torch.cumprod(accepted.long(), dim=1).sum(dim=1)  # [B]
    extra = target_best.gather(1, num_accepted[:, None])  # [B, 1]
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(draft_tokens.shape[0], 1)], dim=1)
    return tokens.scatter(1, num_accepted[:, None], extra), num_accepted


def verify_chain(
    target_probs: torch.Tensor,  # [B, K+1, V] f32: p_1 .. p_{K+1}
    draft_probs: torch.Tensor | None,  # [B, K, V] f32: q_1 .. q_K; None: one-hot at the drafts
    draft_tokens: torch.Tensor,  # [B, K] i64
    num_drafts: torch.Tensor,  # [B] i64: k_b <= K; draft columns past k_b are padding
    seed: torch.Tensor,  # [B] i64
    first_position: torch.Tensor,  # [B] i64: absolute position of the first draft token
) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (tokens [B, K+1] i64: accepted drafts then the recovered/bonus token, padding after;
          num_accepted [B] i64). Row b emits tokens[b, : num_accepted[b] + 1]."""
    b, k = draft_tokens.shape
    rows = torch.arange(b, device=draft_tokens.device)
    cols = torch.arange(k, device=draft_tokens.device)
    # 1. accept test for every draft position at once.
    p_x = target_probs[:, :k].gather(2, draft_tokens[:, :, None])[..., 0]  # [B, K]
    q_x = draft_probs.gather(2, draft_tokens[:, :, None])[..., 0] if draft_probs is not None \
        else torch.ones_like(p_x)  # [B, K]
    positions = first_position[:, None] + cols[None, :]  # [B, K]
    u = _position_uniforms(seed, positions)  # [B, K]
    # u * q < p  <=>  u < p / q, without dividing by a zero q (a q=0 draft never happens
    # for sampled drafts; for one-hot drafts q(x) = 1).
    accepted = (u * q_x < p_x) & (cols[None, :] < num_drafts[:, None])
    # 2. the accepted prefix ends at the first rejection (or at k_b).
    num_accepted = torch.cumprod(accepted.long(), dim=1).sum(dim=1)  # [B]
    # 3. the extra token: residual at the first rejection, or p_{k+1} (bonus) if none.
    p_end = target_probs[rows, num_accepted]  # [B, V]
    all_accepted = num_accepted == num_drafts
    if k == 0:
        q_end = torch.zeros_like(p_end)
    elif draft_probs is None:  # one-hot q: only [B, V], at the first rejected draft's token
        end_token = draft_tokens.gather(1, num_accepted.clamp(max=k - 1)[:, None])
        q_end = torch.zeros_like(p_end).scatter_(1, end_token, 1.0)
    else:
        q_end = draft_probs[rows, num_accepted.clamp(max=k - 1)]
    residual = (p_end - q_end).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # p == q leaves no residual mass; then any rejection had probability 0, so fall back to p.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_end)
    extra_probs = torch.where(all_accepted[:, None], p_end, residual)
    extra = race(extra_probs, seed, first_position + num_accepted, NOISE_SAMPLE)  # [B]
    # 4. assemble accepted drafts + the extra token.
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(b, 1)], dim=1)  # K = 0: [:, :1] is empty
    tokens = tokens.scatter(1, num_accepted[:, None], extra[:, None])
    return tokens, num_accepted


def _position_uniforms(seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One accept-test uniform per (row, position): [B, K] f32."""
    b, k = positions.shape
    flat = uniform_noise(seed.repeat_interleave(k), positions.reshape(-1), NOISE_ACCEPT, 1)
    return flat.view(b, k)
