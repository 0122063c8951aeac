"""Toy "models" as Markov chains, a batched speculative-decoding simulator, and the statistics
that check it (chi-square and total variation against the exact joint distribution).

A model is a matrix M [V, V] (or one per row group: [G, V, V]) with M[prev] the distribution of
the next token given the previous one. The simulator runs the whole speculative loop the way the
engine does (DESIGN.md §3), for thousands of independent requests at once, one row each:

  prompt: one token `start` at position 0; generated token i (1-based) sits at position i.
  step:   L = tokens so far (prompt + generated); the row drafts k_b tokens at positions
          L .. L+k_b-1, draft j from Q(. | previous token) with race(NOISE_DRAFT) at its absolute
          position (the first from the "carried" Q(. | last token)); the target evaluates P along
          [last, d_1 .. d_k] (p_1 .. p_{k+1}); verify_chain gives accepted drafts + one token.
  stop:   when every row has generated N tokens; the last step's surplus is cut off.

Rows draw different k_b (0 .. K) per step, so each verify call is ragged. Draft columns past k_b
are padding, filled with junk (random distributions and tokens; finite, since a NaN would hide a
read through failed comparisons), so a verifier that reads them yields a wrong distribution.
The verifier is passed in (`verify`, default overlap.speculative.rejection.verify_chain), so tree
verification can reuse the loop with its own adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from overlap.sampling import NOISE_DRAFT, race
from overlap.speculative.rejection import verify_chain

Verify = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class SpecRun:
    tokens: torch.Tensor  # [B, N] i64: the generated tokens (prompt excluded)
    accept_counts: torch.Tensor  # [K+1, K+1] i64: [k, a] = verify rows with k drafts, a accepted
    steps: int  # verify calls made


def _per_group(m: torch.Tensor) -> torch.Tensor:
    return m[None] if m.dim() == 2 else m  # [G, V, V]


def simulate(
    P: torch.Tensor,  # [V, V] or [G, V, V] f32: target next-token distributions
    Q: torch.Tensor,  # [V, V] or [G, V, V] f32: draft next-token distributions
    *,
    num_rows: int,
    num_tokens: int,
    max_drafts: int,
    seed_base: int = 0,
    group: torch.Tensor | None = None,  # [B] i64: which of the G matrices a row uses
    start: int | torch.Tensor = 0,  # prompt token, one for all rows or [B] i64
    num_drafts: int | torch.Tensor | None = None,  # k for all rows, or [B] per row; None: random per row and step
    schedule_seed: int = 0,
    verify: Verify = verify_chain,
    verify_q: torch.Tensor | None = None,  # what the engine passes as q (default: Q; a bug injector)
) -> SpecRun:
    P, Q = _per_group(P), _per_group(Q)
    Qv = Q if verify_q is None else _per_group(verify_q)
    vocab, K, N, B = P.shape[-1], max_drafts, num_tokens, num_rows
    group = torch.zeros(B, dtype=torch.long) if group is None else group
    seed = seed_base + torch.arange(B, dtype=torch.long)  # one request seed per row
    sched = torch.Generator().manual_seed(schedule_seed)
    rows = torch.arange(B)
    prompt_len = 1
    out = torch.zeros(B, N + K + 1, dtype=torch.long)  # room for one step's overshoot
    n = torch.zeros(B, dtype=torch.long)  # tokens generated so far
    last = torch.as_tensor(start, dtype=torch.long).expand(B).clone()
    counts = torch.zeros(K + 1, K + 1, dtype=torch.long)
    # one peaked junk distribution for all padding: a verifier that reads it is biased the same
    # way in every row (random junk per row would average out into a much smaller bias).
    pad_probs = torch.softmax(4 * torch.randn(vocab, generator=sched), -1)
    steps = 0
    while bool((n < N).any()):
        active = n < N
        # 1. how many drafts each row proposes this step (ragged batch).
        if num_drafts is None:
            k_b = torch.randint(0, K + 1, (B,), generator=sched)
        else:
            k_b = torch.as_tensor(num_drafts, dtype=torch.long).expand(B)
        first_pos = prompt_len + n  # absolute position of the first draft token
        # 2. draft autoregressively from Q (the first from the carried Q(. | last)).
        prev = last
        drafts, q_rows, p_rows = [], [], [P[group, last]]
        for j in range(K):
            q = Q[group, prev]  # [B, V]
            d = race(q, seed, first_pos + j, NOISE_DRAFT)
            drafts.append(d)
            q_rows.append(Qv[group, prev])
            p_rows.append(P[group, d])  # target evaluated along [last, d_1 .. d_K]
            prev = d
        draft_tokens = torch.stack(drafts, 1) if K else torch.zeros(B, 0, dtype=torch.long)
        draft_probs = torch.stack(q_rows, 1) if K else torch.zeros(B, 0, vocab)
        target_probs = torch.stack(p_rows, 1)  # [B, K+1, V]
        # 3. padding past k_b is junk, as in a reused device buffer.
        cols = torch.arange(K + 1)
        junk_tok = torch.randint(0, vocab, (B, K), generator=sched)
        draft_tokens = torch.where(cols[None, :K] < k_b[:, None], draft_tokens, junk_tok)
        junk = pad_probs.expand(B, K + 1, vocab)
        draft_probs = torch.where((cols[None, :K] < k_b[:, None])[..., None], draft_probs, junk[:, :K])
        target_probs = torch.where((cols[None, :] <= k_b[:, None])[..., None], target_probs, junk)
        # 4. verify, then append accepted drafts + the recovered/bonus token.
        tokens, num_acc = verify(target_probs, draft_probs, draft_tokens, k_b, seed, first_pos)
        emitted = num_acc + 1
        for c in range(K + 1):
            write = active & (c < emitted)
            idx = (n + c).clamp(max=N + K)
            out[rows[write], idx[write]] = tokens[write, c]
        last = torch.where(active, tokens[rows, num_acc], last)
        counts.index_put_((k_b[active], num_acc[active]), torch.ones_like(k_b[active]), accumulate=True)
        n = torch.where(active, n + emitted, n)
        steps += 1
    return SpecRun(tokens=out[:, :N], accept_counts=counts, steps=steps)


# ----------------------------------------------------------------------------- exact laws


def exact_joint(P: torch.Tensor, start: int | torch.Tensor, first: int = 1, length: int = 3) -> torch.Tensor:
    """Exact law of generated tokens first .. first+length-1 (1-based; token i follows i-1, the
    prompt token is token 0) → [V] * length f64. `start`: the prompt token, or [B] per row (the law
    is then the mixture over rows)."""
    P = P.double()
    vocab = P.shape[0]
    start = torch.as_tensor(start, dtype=torch.long).reshape(-1)
    m = torch.bincount(start, minlength=vocab).double() / start.numel()  # law of token 0
    for _ in range(first):
        m = m @ P  # law of token `first`
    joint = m
    for d in range(1, length):
        joint = joint[..., None] * P.view(*([1] * (d - 1)), vocab, vocab)
    return joint


def counts_of(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """tokens [B, L] i64 → the empirical joint counts [V] * L i64."""
    flat = torch.zeros(tokens.shape[0], dtype=torch.long)
    for c in range(tokens.shape[1]):
        flat = flat * vocab + tokens[:, c]
    return torch.bincount(flat, minlength=vocab ** tokens.shape[1]).view(*([vocab] * tokens.shape[1]))


# ----------------------------------------------------------------------------- statistics


def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution (no scipy): Q(df/2, x/2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def chi_square_gof(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0):
    """Pearson goodness of fit of counts to probs (any shape, flattened). Every cell with expected
    count below min_expected goes into one pooled cell (which takes the next smallest cells too
    while its own expectation is below min_expected), so no cell of the statistic expects fewer
    than min_expected (many tiny cells would give it a heavy tail: false alarms). Cells of
    probability 0 must be empty (else p-value 0). → (statistic, degrees of freedom, p-value)."""
    c = counts.reshape(-1).double()
    p = probs.reshape(-1).double()
    if bool((c[p <= 0] > 0).any()):
        return math.inf, 0, 0.0
    c, p = c[p > 0], p[p > 0]
    exp = c.sum() * p / p.sum()
    order = torch.argsort(exp)
    exp, c = exp[order], c[order]
    cut = int((exp < min_expected).sum())
    cum = exp.cumsum(0)
    while 0 < cut < exp.numel() and float(cum[cut - 1]) < min_expected:
        cut += 1
    if cut > 1:
        exp = torch.cat([exp[:cut].sum()[None], exp[cut:]])
        c = torch.cat([c[:cut].sum()[None], c[cut:]])
    stat = float(((c - exp) ** 2 / exp).sum())
    df = exp.numel() - 1
    return stat, df, (chi2_sf(stat, df) if df > 0 else 1.0)


def chi_square_independence(table: torch.Tensor):
    """Pearson test of independence for a 2-D contingency table → (statistic, df, p-value)."""
    t = table.double()
    t = t[t.sum(1) > 0][:, t.sum(0) > 0]
    exp = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    stat = float(((t - exp) ** 2 / exp).sum())
    df = (t.shape[0] - 1) * (t.shape[1] - 1)
    return stat, df, chi2_sf(stat, df)


def tv_tolerance(num_samples: int, num_cells: int, delta: float) -> float:
    """A total-variation bound that the empirical law of n i.i.d. draws over m cells exceeds with
    probability at most delta (Bretagnolle–Huber–Carol: P(|p̂-p|_1 >= e) <= 2^m exp(-n e^2 / 2))."""
    return math.sqrt((num_cells * math.log(2) + math.log(1 / delta)) / (2 * num_samples))


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    c = counts.reshape(-1).double()
    return 0.5 * float((c / c.sum() - probs.reshape(-1).double()).abs().sum())


# ----------------------------------------------------------------------------- the law of L tokens

ALPHA = 1e-3  # the false-alarm rate of one assert_law call, whatever L (Bonferroni below)


def law_pvalues(tokens: torch.Tensor, law: torch.Tensor) -> dict[str, float]:
    """tokens [N, L] i64 and the exact joint law [V] * L of those L tokens → the p-values of a
    family of Pearson chi-square tests: the whole joint (small cells pooled), each token's
    marginal, and each pair of neighbours. A bias of one position's law shows in its marginal
    with N samples over V cells (far more power than the joint's N over V^L cells); a bias in
    how a token depends on the one before shows in their pair."""
    vocab, length = law.shape[0], law.dim()
    counts = counts_of(tokens, vocab)
    out = {"joint": chi_square_gof(counts, law)[2]}
    for i in range(length):
        others = [d for d in range(length) if d != i]
        out[f"token {i + 1}"] = chi_square_gof(counts.sum(others) if others else counts,
                                               law.sum(others) if others else law)[2]
    for i in range(length - 1):
        others = [d for d in range(length) if d not in (i, i + 1)]
        out[f"tokens {i + 1},{i + 2}"] = chi_square_gof(counts.sum(others) if others else counts,
                                                        law.sum(others) if others else law)[2]
    return out


def law_rejected(tokens: torch.Tensor, law: torch.Tensor, alpha: float = ALPHA) -> tuple[bool, dict[str, float]]:
    """Bonferroni over the family: reject when any p-value is below alpha / (number of tests), so a
    correct sampler is rejected with probability at most alpha."""
    pvalues = law_pvalues(tokens, law)
    return min(pvalues.values()) < alpha / len(pvalues), pvalues


def assert_law(tokens: torch.Tensor, law: torch.Tensor, alpha: float = ALPHA) -> None:
    rejected, pvalues = law_rejected(tokens, law, alpha)
    assert not rejected, "law of the generated tokens rejected at alpha={}: {}".format(
        alpha, {k: f"{v:.2e}" for k, v in pvalues.items()})
