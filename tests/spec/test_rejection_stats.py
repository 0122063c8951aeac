"""Speculative sampling preserves the target distribution (DESIGN.md §6), checked statistically.

Toy target and draft "models" are Markov chains over a small vocabulary; markov.simulate runs the
whole speculative loop (draft k tokens, verify_chain, append, repeat) for many independent
requests at once, each row its own seed and its own random draft count per step. The empirical
joint law of three generated tokens is compared with the exact one from P.

False-failure rate: all noise is counter-based and keyed by the fixed row seeds, so every test is
deterministic. Were the seeds drawn at random, a correct verifier would fail a chi-square assert
with probability ALPHA and a total-variation assert with probability DELTA (a distribution-free
bound); this file makes 7 chi-square and 21 TV asserts, under 1e-3 in all. The power tests at the
end show that plausible engine bugs fail the same asserts by a wide margin.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from markov import (  # noqa: E402
    chi_square_gof,
    counts_of,
    exact_joint,
    simulate,
    total_variation,
    tv_tolerance,
)

from overlap.sampling import NOISE_ACCEPT, NOISE_SAMPLE, SamplingTensors, probabilities, race, sample, uniform_noise  # noqa: E402,E501
from overlap.spec.rejection import verify_chain  # noqa: E402

ALPHA = 1e-4  # per chi-square assert
DELTA = 1e-5  # per total-variation assert
V = 6
K = 4  # max drafts per step; rows draw k_b in 0..K each step
ROWS = 50_000
START = torch.arange(ROWS) % V  # prompt token per row: every "carried" draft row gets used


def _markov(seed: int, vocab: int = V, sharp: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(vocab, vocab, generator=g), dim=-1)  # [V, V] f32


def _st(n: int, temperature: float, top_k: int = 0, top_p: float = 1.0) -> SamplingTensors:
    return SamplingTensors(
        temperature=torch.full((n,), temperature), top_k=torch.full((n,), top_k),
        top_p=torch.full((n,), top_p), seed=torch.zeros(n, dtype=torch.long),
        all_greedy=temperature == 0, any_greedy=temperature == 0,
        any_top_k=top_k > 0, any_top_p=top_p < 1.0)


def assert_target_law(tokens: torch.Tensor, P: torch.Tensor, start, first: int = 1) -> None:
    """tokens [B, 3]: generated tokens first..first+2 follow the exact joint law of P."""
    vocab = P.shape[-1]
    joint = exact_joint(P, start, first, 3)
    stat, df, pval = chi_square_gof(counts_of(tokens, vocab), joint)
    assert pval > ALPHA, f"joint law of 3 tokens: chi2={stat:.1f} df={df} p={pval:.2e}"
    tol = tv_tolerance(tokens.shape[0], vocab, DELTA)
    for i in range(3):
        marginal = joint.sum(dim=[d for d in range(3) if d != i])
        tv = total_variation(torch.bincount(tokens[:, i], minlength=vocab), marginal)
        assert tv < tol, f"marginal of token {first + i}: TV {tv:.4f} >= {tol:.4f}"


def assert_all_paths(accept_counts: torch.Tensor) -> None:
    """Every draft count 0..K occurred, and for each k every accepted count 0..k (rejection at
    each draft position, and the bonus token when all k are accepted)."""
    for k in range(K + 1):
        for a in range(k + 1):
            assert accept_counts[k, a] > 0, f"never saw {a} of {k} drafts accepted:\n{accept_counts}"


def test_full_draft_distribution():
    P, Q = _markov(0), _markov(1)
    run = simulate(P, Q, num_rows=ROWS, num_tokens=3, max_drafts=K, start=START)
    assert_all_paths(run.accept_counts)
    assert_target_law(run.tokens, P, START)


def test_later_tokens_across_steps():
    """Tokens 4..6 come after one or more verify steps (positions of rejected drafts are drafted
    again with fresh state but the same counter noise): their law must still be exact."""
    P, Q = _markov(2), _markov(3)
    run = simulate(P, Q, num_rows=ROWS, num_tokens=6, max_drafts=K, start=START, seed_base=10**6)
    assert run.steps > 2
    assert_target_law(run.tokens[:, 3:6], P, START, first=4)


def test_one_hot_draft():
    """A deterministic drafter: q is one-hot on the argmax of another (related) model."""
    P = _markov(4)
    R = P.log() + 1.5 * torch.randn(V, V, generator=torch.Generator().manual_seed(5))
    Q = torch.zeros_like(R).scatter_(1, R.argmax(-1, keepdim=True), 1.0)
    assert not torch.equal(Q.argmax(-1), P.argmax(-1))
    run = simulate(P, Q, num_rows=ROWS, num_tokens=3, max_drafts=K, start=START, seed_base=2 * 10**6)
    assert_all_paths(run.accept_counts)
    assert_target_law(run.tokens, P, START)


def test_draft_equal_to_target_accepts_everything():
    P = _markov(6)
    run = simulate(P, P, num_rows=ROWS, num_tokens=3, max_drafts=K, start=START, seed_base=3 * 10**6)
    c = run.accept_counts
    assert int(c.sum()) == int(c.diagonal().sum()), f"q == p must never reject:\n{c}"
    assert_target_law(run.tokens, P, START)


def test_disjoint_support_rejects_everything():
    """q puts all its mass where p has none: every first draft is rejected, the residual is p."""
    g = torch.Generator().manual_seed(7)
    support = torch.rand(V, V, generator=g).argsort(-1) < V // 2  # [V, V] bool, half per row
    P = torch.where(support, _markov(8), 0.0)
    P = P / P.sum(-1, keepdim=True)
    Q = torch.where(~support, _markov(9), 0.0)
    Q = Q / Q.sum(-1, keepdim=True)
    run = simulate(P, Q, num_rows=ROWS, num_tokens=3, max_drafts=K, start=START, seed_base=4 * 10**6)
    assert int(run.accept_counts[:, 1:].sum()) == 0
    assert_target_law(run.tokens, P, START)


def test_temperature_top_k_top_p_on_both():
    """p and q are the distributions after the request's temperature / top-k / top-p, built by
    overlap.sampling.probabilities from logits (truncated supports differ between the two)."""
    vocab = 8
    g = torch.Generator().manual_seed(10)
    target_logits = 2.0 * torch.randn(vocab, vocab, generator=g)
    draft_logits = target_logits + 1.5 * torch.randn(vocab, vocab, generator=g)
    st = _st(vocab, temperature=0.8, top_k=5, top_p=0.9)
    P, Q = probabilities(target_logits, st), probabilities(draft_logits, st)
    assert bool((P == 0).any()) and bool(((P == 0) != (Q == 0)).any())  # truncation matters
    start = torch.arange(ROWS) % vocab
    run = simulate(P, Q, num_rows=ROWS, num_tokens=3, max_drafts=K, start=start, seed_base=5 * 10**6)
    assert_target_law(run.tokens, P, start)


def test_greedy_is_exactly_the_greedy_chain_in_a_mixed_batch():
    """Temperature 0 rows (one-hot p and q from probabilities) reproduce the target's greedy
    chain token for token, in the same verify calls as sampled rows."""
    vocab, n_tok = 8, 6
    g = torch.Generator().manual_seed(11)
    target_logits = 2.0 * torch.randn(vocab, vocab, generator=g)
    draft_logits = target_logits + 2.0 * torch.randn(vocab, vocab, generator=g)  # often disagrees
    greedy, sampled = _st(vocab, 0.0), _st(vocab, 1.0)
    P = torch.stack([probabilities(target_logits, greedy), probabilities(target_logits, sampled)])
    Q = torch.stack([probabilities(draft_logits, greedy), probabilities(draft_logits, sampled)])
    group = torch.arange(ROWS) % 2  # even rows greedy, odd rows sampled
    start = (torch.arange(ROWS) // 2) % vocab
    run = simulate(P, Q, num_rows=ROWS, num_tokens=n_tok, max_drafts=K, start=start, group=group,
                   seed_base=6 * 10**6)
    chain = torch.empty(vocab, n_tok, dtype=torch.long)  # greedy continuation of each prompt
    prev = torch.arange(vocab)
    for i in range(n_tok):
        prev = target_logits[prev].argmax(-1)
        chain[:, i] = prev
    g_rows = group == 0
    assert torch.equal(run.tokens[g_rows], chain[start[g_rows]])
    assert_target_law(run.tokens[~g_rows, :3], P[1], start[~g_rows])


def test_without_drafts_speculation_samples_the_same_tokens():
    """k = 0 is plain sampling, token for token: the extra token's noise is keyed by the position
    it lands on (sampling.py), so a request samples the same with speculation off, with max K = 0,
    or with k_b = 0 inside a batch of rows that do draft."""
    vocab, rows, n_tok = 8, 2000, 5
    g = torch.Generator().manual_seed(12)
    target_logits = 2.0 * torch.randn(vocab, vocab, generator=g)
    st_v = _st(vocab, temperature=0.9, top_k=6)
    P = probabilities(target_logits, st_v)
    start = torch.arange(rows) % vocab
    seed = 7 * 10**6 + torch.arange(rows)  # simulate's seeds for seed_base=7e6
    st = SamplingTensors(temperature=torch.full((rows,), 0.9), top_k=torch.full((rows,), 6),
                         top_p=torch.ones(rows), seed=seed, all_greedy=False, any_greedy=False,
                         any_top_k=True, any_top_p=False)
    plain = torch.empty(rows, n_tok, dtype=torch.long)
    prev = start
    for i in range(n_tok):  # non-speculative decoding: token i sits at position i
        prev = sample(target_logits[prev], st, torch.full((rows,), i + 1))
        plain[:, i] = prev
    spec = simulate(P, _markov(13, vocab), num_rows=rows, num_tokens=n_tok, max_drafts=0,
                    start=start, seed_base=7 * 10**6)
    assert torch.equal(spec.tokens, plain)
    k_b = torch.arange(rows) % (K + 1)
    ragged = simulate(P, _markov(13, vocab), num_rows=rows, num_tokens=n_tok, max_drafts=K,
                      start=start, seed_base=7 * 10**6, num_drafts=k_b)
    assert torch.equal(ragged.tokens[k_b == 0], plain[k_b == 0])
    assert not torch.equal(ragged.tokens[k_b > 0], plain[k_b > 0])  # drafting rows: same law only


def test_noise_is_keyed_by_position():
    """The accept uniform of draft j is u(seed, position of draft j, NOISE_ACCEPT); the extra token
    is race(residual or p, seed, its own position, NOISE_SAMPLE). A recompute after preemption
    (same seed, same positions) then replays the same tokens."""
    b, vocab = 4000, 7
    g = torch.Generator().manual_seed(14)
    p = torch.softmax(2 * torch.randn(b, K + 1, vocab, generator=g), -1)
    q = torch.softmax(2 * torch.randn(b, K, vocab, generator=g), -1)
    drafts = torch.randint(0, vocab, (b, K), generator=g)
    k_b = torch.arange(b) % (K + 1)
    seed = torch.randint(0, 2**40, (b,), generator=g)
    first = torch.randint(1, 5000, (b,), generator=g)
    tokens, num_acc = verify_chain(p, q, drafts, k_b, seed, first)
    rows = torch.arange(b)
    for j in range(K):  # accept test, column by column
        u = uniform_noise(seed, first + j, NOISE_ACCEPT, 1)[:, 0]
        px, qx = p[rows, j, drafts[:, j]], q[rows, j, drafts[:, j]]
        reached = (num_acc >= j) & (j < k_b)
        assert torch.equal((num_acc > j)[reached], (u * qx < px)[reached]), j
        assert torch.equal(tokens[num_acc > j, j], drafts[num_acc > j, j])
    p_end = p[rows, num_acc]
    residual = (p_end - q[rows, num_acc.clamp(max=K - 1)]).clamp_min(0)
    residual = residual / residual.sum(-1, keepdim=True)
    extra_probs = torch.where((num_acc == k_b)[:, None], p_end, residual)
    extra = race(extra_probs, seed, first + num_acc, NOISE_SAMPLE)
    assert torch.equal(tokens[rows, num_acc], extra)
    assert bool((num_acc < k_b).any()) and bool(((num_acc == k_b) & (k_b > 0)).any())


# ----------------------------------------------------------------------------- power checks


def test_detects_wrong_q():
    """An engine that hands the verifier p as q (e.g. forgot the draft's temperature) accepts
    every draft; the output then follows Q, and the chi-square must say so loudly."""
    P, Q = _markov(0), _markov(1)
    run = simulate(P, Q, num_rows=ROWS, num_tokens=3, max_drafts=K, start=START, verify_q=P)
    stat, df, pval = chi_square_gof(counts_of(run.tokens, V), exact_joint(P, START, 1, 3))
    assert pval < 1e-12, (stat, df, pval)


def test_detects_bonus_from_wrong_position():
    """Off by one in the target rows: the bonus token drawn from p_k instead of p_{k+1}."""

    def bonus_off_by_one(tp, dp, dt, k, seed, first_pos):
        b = torch.arange(tp.shape[0])
        tp = tp.clone()
        tp[b, k] = tp[b, (k - 1).clamp(min=0)]
        return verify_chain(tp, dp, dt, k, seed, first_pos)

    P, Q = _markov(0), _markov(1)
    run = simulate(P, Q, num_rows=ROWS, num_tokens=3, max_drafts=K, start=START,
                   verify=bonus_off_by_one)
    stat, df, pval = chi_square_gof(counts_of(run.tokens, V), exact_joint(P, START, 1, 3))
    assert pval < 1e-12, (stat, df, pval)
