"""Speculative sampling preserves the target distribution (DESIGN.md §6), checked statistically.

Toy target and draft "models" are Markov chains over a small vocabulary; markov.simulate runs the
whole speculative loop (draft k tokens, verify_chain, append, repeat) for many independent
requests at once, each row its own seed and its own random draft count per step (0..K). The
empirical law of K+1 = 5 generated tokens (a first step with K drafts, all accepted, emits
exactly those: drafts at every depth and the bonus after the K-th are inside the window) is
compared with the exact one from P by markov.assert_law: a family of chi-square tests (the
joint, each token, each neighbour pair) with Bonferroni, ALPHA = 1e-3 per assert_law call.

False-failure rate: all noise is counter-based and keyed by the fixed row seeds, so every test is
deterministic. Were the seeds drawn at random, a correct verifier would fail an assert_law with
probability at most ALPHA. The power tests at the end run the same sample sizes through broken
verifiers (speculative/doubles.py, at every depth or only at depth K) and show the same test rejects
them with p-values far below ALPHA / m.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import doubles  # noqa: E402
import pytest  # noqa: E402
from markov import assert_law, exact_joint, law_rejected, simulate  # noqa: E402

from overlap.sampling import NOISE_ACCEPT, NOISE_SAMPLE, SamplingTensors, probabilities, race, sample, uniform_noise  # noqa: E402,E501
from overlap.speculative.rejection import verify_chain  # noqa: E402
from overlap.speculative.tree import TreeShape, verify_tree  # noqa: E402

V = 6
K = 4  # max drafts per step; rows draw k_b in 0..K each step
L = K + 1  # tokens checked: one step's K drafts and its bonus
ROWS = 100_000
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
    """tokens [B, n]: generated tokens first..first+n-1 follow the exact joint law of P."""
    assert_law(tokens, exact_joint(P, start, first, tokens.shape[1]))


def assert_all_paths(accept_counts: torch.Tensor) -> None:
    """Every draft count 0..K occurred, and for each k every accepted count 0..k (rejection at
    each draft position, and the bonus token when all k are accepted)."""
    for k in range(K + 1):
        for a in range(k + 1):
            assert accept_counts[k, a] > 0, f"never saw {a} of {k} drafts accepted:\n{accept_counts}"


@pytest.mark.parametrize("num_drafts", [None, K])
def test_full_draft_distribution(num_drafts):
    """Ragged k_b per row and step, or k = K in every step (five times the depth-K traffic)."""
    P, Q = _markov(0), _markov(1)
    run = simulate(P, Q, num_rows=ROWS, num_tokens=L, max_drafts=K, start=START, num_drafts=num_drafts)
    if num_drafts is None:
        assert_all_paths(run.accept_counts)
    else:
        assert all(run.accept_counts[K, a] > 0 for a in range(K + 1)), run.accept_counts
    assert_target_law(run.tokens, P, START)


def test_later_tokens_across_steps():
    """Tokens 6..10 come after one or more verify steps (positions of rejected drafts are drafted
    again with fresh state but the same counter noise): their law must still be exact."""
    P, Q = _markov(2), _markov(3)
    run = simulate(P, Q, num_rows=ROWS, num_tokens=2 * L, max_drafts=K, start=START, seed_base=10**6)
    assert run.steps > 2
    assert_target_law(run.tokens[:, L:], P, START, first=L + 1)


def test_one_hot_draft():
    """A deterministic drafter: q is one-hot on the argmax of another (related) model."""
    P = _markov(4)
    R = P.log() + 1.5 * torch.randn(V, V, generator=torch.Generator().manual_seed(5))
    Q = torch.zeros_like(R).scatter_(1, R.argmax(-1, keepdim=True), 1.0)
    assert not torch.equal(Q.argmax(-1), P.argmax(-1))
    run = simulate(P, Q, num_rows=ROWS, num_tokens=L, max_drafts=K, start=START, seed_base=2 * 10**6)
    assert_all_paths(run.accept_counts)
    assert_target_law(run.tokens, P, START)


def test_draft_equal_to_target_accepts_everything():
    P = _markov(6)
    run = simulate(P, P, num_rows=ROWS, num_tokens=L, max_drafts=K, start=START, seed_base=3 * 10**6)
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
    run = simulate(P, Q, num_rows=ROWS, num_tokens=L, max_drafts=K, start=START, seed_base=4 * 10**6)
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
    run = simulate(P, Q, num_rows=ROWS, num_tokens=L, max_drafts=K, start=start, seed_base=5 * 10**6)
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
    assert_target_law(run.tokens[~g_rows, :L], P[1], start[~g_rows])


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


def _rejected(run, P) -> None:
    rejected, pvalues = law_rejected(run.tokens, exact_joint(P, START, 1, L))
    assert rejected, pvalues


def test_detects_wrong_q():
    """An engine that hands the verifier p as q (e.g. forgot the draft's temperature) accepts
    every draft; the output then follows Q, and the test must say so."""
    P, Q = _markov(0), _markov(1)
    _rejected(simulate(P, Q, num_rows=ROWS, num_tokens=L, max_drafts=K, start=START, verify_q=P), P)


def test_detects_bonus_from_wrong_position():
    """Off by one in the target rows: the bonus token drawn from p_k instead of p_{k+1}."""

    def bonus_off_by_one(tp, dp, dt, k, seed, first_pos):
        b = torch.arange(tp.shape[0])
        tp = tp.clone()
        tp[b, k] = tp[b, (k - 1).clamp(min=0)]
        return verify_chain(tp, dp, dt, k, seed, first_pos)

    P, Q = _markov(0), _markov(1)
    _rejected(simulate(P, Q, num_rows=ROWS, num_tokens=L, max_drafts=K, start=START, verify=bonus_off_by_one), P)


@pytest.mark.parametrize("bug", sorted(doubles.BUGS))
@pytest.mark.parametrize("at_depth", [None, K])
def test_detects_a_broken_verifier(bug, at_depth):
    """The recovered token drawn from p instead of the residual, or the accept test reading p
    from the next row: at every depth (ragged k_b), or only at depth K (k = K in every step, as
    in test_full_draft_distribution[4]: a bug there needs a window that holds depth-K drafts and
    a sample with enough of them)."""
    P, Q = _markov(0), _markov(1)
    verify = functools.partial(doubles.verify_chain, **doubles.broken(bug, at_depth))
    _rejected(simulate(P, Q, num_rows=ROWS, num_tokens=L, max_drafts=K, start=START, verify=verify,
                       num_drafts=at_depth), P)


def test_the_doubles_without_a_bug_are_the_real_verifiers():
    b, vocab = 4000, 7
    g = torch.Generator().manual_seed(15)
    p = torch.softmax(2 * torch.randn(b, K + 1, vocab, generator=g), -1)
    q = torch.softmax(2 * torch.randn(b, K, vocab, generator=g), -1)
    drafts = torch.randint(0, vocab, (b, K), generator=g)
    k_b = torch.arange(b) % (K + 1)
    seed = torch.randint(0, 2**40, (b,), generator=g)
    first = torch.randint(1, 5000, (b,), generator=g)
    for want, got in zip(verify_chain(p, q, drafts, k_b, seed, first),
                         doubles.verify_chain(p, q, drafts, k_b, seed, first)):
        assert torch.equal(want, got)
    shape = TreeShape.default(3, 2, 6)
    n = shape.size
    args = (torch.softmax(2 * torch.randn(b, n + 1, vocab, generator=g), -1),
            torch.randint(0, vocab, (b, n), generator=g), torch.tensor(shape.parents()).expand(b, n),
            torch.tensor(shape.sibling_order()).expand(b, n), shape.depth, shape.max_children(), seed, first)
    for want, got in zip(verify_tree(*args), doubles.verify_tree(*args)):
        assert torch.equal(want, got)
